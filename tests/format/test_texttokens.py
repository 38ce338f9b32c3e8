"""Text prompts' token ids (``format.texttokens``, ``--tokenizer DIR`` of ``capture``,
``capture import`` and ``replay``): SGLang's metrics line of a string prompt holds the text,
not the ids. The real fixture with every prompt turned into text (a word-level tokenizer of
its ids: ``t<id>`` is token ``id``) replays exactly as it does from its ids; a tokenizer
that is not the worker's (its count is not ``prompt_tokens``) leaves the records without ids
and says so; a bad directory or a missing ``transformers`` is one line and exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcadence.capture.importer import import_bundle
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.format.texttokens import TextTokenizer, prompt_text
from kvcadence.replay.tokens import as_list


def word_tokenizer(d: Path, bos: int | None = None) -> Path:
    """A word-level tokenizer of 1024 ids (``t<i>`` -> ``i``, ``t0`` unknown), saved as
    ``transformers`` saves one; ``bos``: the id its post-processor puts first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(1024)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"t{bos} $A", special_tokens=[(f"t{bos}", bos)]
        )
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(d))
    return d


def text_metrics(src: Path, dst: Path) -> int:
    """SGLang metrics files with every prompt sent as text (``request_parameters.text``,
    no ``input_ids``), as a string prompt to ``/generate`` is logged; how many lines."""
    dst.mkdir()
    n = 0
    for f in sorted(src.iterdir()):
        lines = []
        for line in f.read_text().splitlines():
            d = json.loads(line)
            params = json.loads(d["request_parameters"])
            params["text"] = " ".join(f"t{i}" for i in params.pop("input_ids"))
            d["request_parameters"] = json.dumps(params)
            lines.append(json.dumps(d))
            n += 1
        (dst / f.name).write_text("\n".join(lines) + "\n")
    return n


def _events_bundle(fixture_dir: Path, out: Path) -> Path:
    import_bundle(
        out,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    return out


def test_text_prompts_replay_as_their_ids_do(fixture_dir, tmp_path, capsys):
    tok = word_tokenizer(tmp_path / "tok")
    texts = tmp_path / "texts"
    assert text_metrics(fixture_dir / "sglang-metrics", texts) == 120
    ids = _events_bundle(fixture_dir, tmp_path / "ids")
    argv = ["capture", "import", "--sglang-metrics"]
    assert main([*argv, str(fixture_dir / "sglang-metrics"), "--quiet", str(ids)]) == 0
    # without the tokenizer: the records hold no ids, the replay refuses and says what to do
    bare = _events_bundle(fixture_dir, tmp_path / "bare")
    assert main([*argv, str(texts), "--quiet", str(bare)]) == 0
    assert all(not r.input_ids and prompt_text(r) for r in BundleReader(bare).requests())
    capsys.readouterr()
    assert main(["replay", str(bare), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a text prompt" in err[0] and "--tokenizer" in err[0], err
    # with it, at import: the ids SGLang's tokenizer gave them, flagged as kvcadence's
    text = _events_bundle(fixture_dir, tmp_path / "text")
    assert main([*argv, str(texts), "--tokenizer", str(tok), str(text)]) == 0
    assert "120 text prompts tokenized" in capsys.readouterr().err
    want = {r.rid: as_list(r.input_ids) for r in BundleReader(ids).requests()}
    got = BundleReader(text).requests()
    assert {r.rid: as_list(r.input_ids) for r in got} == want
    assert all(r.meta_info["kvcadence_tokenized"] is True for r in got)
    # the replays: the same event stream as the ids' (and at replay, from the bare bundle)
    runs = [("ids", []), ("text", []), ("bare", ["--tokenizer", str(tok)])]
    streams = []
    for name, extra in runs:
        out = tmp_path / f"sim-{name}"
        assert main(["replay", str(tmp_path / name), "--out", str(out), *extra]) == 0
        streams.append([event_payload(f) for f in BundleReader(out).events()])
    assert streams[0] == streams[1] == streams[2] and len(streams[0]) > 100
    assert "120 text prompts tokenized (--tokenizer)" in capsys.readouterr().out


def test_another_tokenizer_leaves_the_records_without_ids(fixture_dir, tmp_path, capsys):
    """A tokenizer that puts a BOS first counts one token more than the worker did: no
    record takes its ids, the summary says how many and names the first."""
    tok = word_tokenizer(tmp_path / "tok", bos=1)
    t = TextTokenizer(str(tok))
    assert t.encode("t5 t7 t1023") == [1, 5, 7, 1023]  # special tokens as it adds them
    texts = tmp_path / "texts"
    text_metrics(fixture_dir / "sglang-metrics", texts)
    b = _events_bundle(fixture_dir, tmp_path / "b")
    capsys.readouterr()
    argv = ["capture", "import", "--sglang-metrics", str(texts), "--tokenizer", str(tok), str(b)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        "0 text prompts tokenized (--tokenizer), 120 left without ids" in err
        and "the worker counted" in err
    )
    assert all(not r.input_ids for r in BundleReader(b).requests())


def test_bad_tokenizer_options_are_one_line(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "m").mkdir()
    b = tmp_path / "b"
    cases = [
        ["capture", "import", "--sglang-metrics", str(tmp_path / "m"), "--tokenizer", str(empty)],
        ["capture", "--endpoint", "tcp://127.0.0.1:5557", "--tokenizer", str(empty)],
    ]
    for argv in cases:
        assert main([*argv, str(b)] if argv[1] == "import" else [*argv, "--out", str(b)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--tokenizer" in err[0], err
        assert not b.exists()
    (empty / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(Exception, match="cannot load it"):
        TextTokenizer(str(empty))
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    word = tmp_path / "word"
    word.mkdir()
    (word / "tokenizer.json").write_text("{}")
    sample = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"
    argv = ["replay", str(sample), "--out", str(tmp_path / "o"), "--tokenizer", str(word)]
    assert main(argv) == 2 and not (tmp_path / "o").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'kvcadence[tokenizer]'" in err[0], err


def test_the_live_tail_tokenizes_text_prompts(fixture_dir, tmp_path):
    """``capture --sglang-metrics DIR --tokenizer TOK``: the tail gives each text prompt's
    record its ids as it reads the line; its counters go into the capture's summary."""
    from kvcadence.capture.tail import LogTail, summary_text

    texts = tmp_path / "texts"
    text_metrics(fixture_dir / "sglang-metrics", texts)
    got: list = []
    tok = TextTokenizer(str(word_tokenizer(tmp_path / "tok")))
    st = LogTail(got.append, metrics=[texts], from_start=True, tokenizer=tok).stop()
    want = [list(r.input_ids) for r in BundleReader(_ids_bundle(fixture_dir, tmp_path)).requests()]
    assert [list(r.input_ids) for r in got] == want and st.tokenized == 120
    assert "120 text prompts tokenized (--tokenizer)" in summary_text(st, None)


def _ids_bundle(fixture_dir: Path, tmp_path: Path) -> Path:
    b = _events_bundle(fixture_dir, tmp_path / "ids")
    assert main(["capture", "import", "--quiet", "--sglang-metrics",
                 str(fixture_dir / "sglang-metrics"), str(b)]) == 0  # fmt: skip
    return b


def test_fleets_and_sweeps_take_the_tokenizer(fixture_dir, tmp_path):
    """``replay --route ... --tokenizer`` (the fleet path) and ``replay --sweep ...
    --tokenizer`` (each job loads it) replay a bundle of text prompts; without it both
    refuse, naming the option."""
    import duckdb

    tok = word_tokenizer(tmp_path / "tok")
    texts = tmp_path / "texts"
    text_metrics(fixture_dir / "sglang-metrics", texts)
    bare = _events_bundle(fixture_dir, tmp_path / "bare")
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(texts), str(bare)]) == 0
    fleet = ["replay", str(bare), "--route", "recorded", "--quiet", "--out"]
    assert main([*fleet, str(tmp_path / "f0")]) == 2
    assert main([*fleet, str(tmp_path / "f1"), "--tokenizer", str(tok)]) == 0
    assert len(BundleReader(tmp_path / "f1").requests()) == 120  # one worker: one bundle
    sweep = ["replay", str(bare), "--sweep", "route=recorded,round_robin", "--json", "--out"]
    assert main([*sweep, str(tmp_path / "s0")]) == 2
    assert main([*sweep, str(tmp_path / "s1"), "--tokenizer", str(tok)]) == 0
    rows = duckdb.sql(
        f"select count(*) from read_parquet('{tmp_path / 's1'}/**/*.parquet', "
        "hive_partitioning = true) where kind = 'request'"
    ).fetchall()
    assert rows == [(240,)]  # 120 requests in each of the two jobs
