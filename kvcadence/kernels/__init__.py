"""Kernels stage: replay observed prefix sizes through torch.distributed collective paths.

Imports only the standard library and torch (a GPU box may have nothing else).
"""
