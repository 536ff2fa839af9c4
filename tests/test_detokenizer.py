"""Detokenizer: incremental decoding against one-shot `tokenizer.decode` of the default model's
tokenizer (byte-level BPE), stop-string hold-back and trimming, and the real process over ipc."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import pytest
import regex
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.srt import io_struct
from radixlm.srt.detokenizer.manager import DetokenizerManager
from radixlm.srt.entrypoints.detokenizer import run_detokenizer_process
from radixlm.srt.detokenizer.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from radixlm.srt.detokenizer.text_decoder import RustDecoder, load_decoder, rust_decoder
from radixlm.srt.executor.gguf_loader import convert_gguf_tokenizer
from radixlm.srt.io_struct import BatchTextOut, BatchTokenOut, ControlReply, ReadySignal, ReqOutput
from radixlm.srt.executor.model_loader import load_tokenizer

from benchmarks.models import LLAMA3_TOKENIZER_GGUF

TEXTS = [
    "Hello 😀 wörld 你好, naïve café — ok?",
    "Emoji run: 🎉🎉👨‍👩‍👧🇫🇷 and 日本語のテキスト with Ünïcödé accents ñ ç ø å.",
    "Код на русском; عربى; हिन्दी; 한국어 텍스트 🙂\n\n```python\nprint('hi')\n```",
    "Plain ASCII text, nothing special: 1 + 1 = 2.",
]
LENGTH: dict[str, Any] = {"type": "length", "matched": None}


@pytest.fixture(scope="module")
def tok(default_model):
    return load_tokenizer(default_model.local_dir)


@pytest.fixture(scope="module")
def partial_ids(tok) -> list[int]:
    """Tokens that alone decode to an incomplete UTF-8 sequence (bytes of a split character)."""
    return [i for i in range(len(tok)) if REPLACEMENT_CHAR in tok.decode([i])]


def stream(tok, ids: Sequence[int], chunks: Sequence[int] = (1,), finish: dict | None = None,
           **options: Any) -> list[str]:
    """Feeds `ids` in chunks of the given sizes (cycled); returns the deltas, finish's last."""
    detok = IncrementalDetokenizer(tok, **options)
    deltas, pos, step = [], 0, 0
    while pos < len(ids):
        size = chunks[step % len(chunks)]
        deltas.append(detok.feed(ids[pos:pos + size]))
        pos, step = pos + size, step + 1
    deltas.append(detok.finish(finish or LENGTH))
    return deltas


def stream_until_stop(tok, ids: Sequence[int], stop: list[str], no_stop_trim: bool = False):
    """Plays the scheduler: one id per step, finishing at the first step whose decoded output
    contains a stop string. Returns (deltas, the full decoded output, the matched stop)."""
    detok = IncrementalDetokenizer(tok, stop=stop, no_stop_trim=no_stop_trim)
    deltas = []
    for n in range(1, len(ids) + 1):
        deltas.append(detok.feed(ids[n - 1:n]))
        full = tok.decode(ids[:n], skip_special_tokens=True)
        matched = next((s for s in stop if s in full), None)
        if matched is not None:
            deltas.append(detok.finish({"type": "stop", "matched": matched}))
            return deltas, full, matched
    deltas.append(detok.finish(LENGTH))
    return deltas, tok.decode(ids, skip_special_tokens=True), None


def assert_streamed_prefixes(deltas: list[str], final: str) -> None:
    """What a streaming client has seen is at every step a prefix of the final text."""
    seen = ""
    for delta in deltas:
        seen += delta
        assert final.startswith(seen), (seen, final)
    assert seen == final


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [(1,), (2,), (3, 1), (100,)])
def test_stream_equals_full_decode_on_real_text(tok, text, chunks):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, ids, chunks)
    assert_streamed_prefixes(deltas, tok.decode(ids, skip_special_tokens=True))
    assert "".join(deltas) == text
    # Valid text never shows a partial character, not even for one step.
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_emoji_split_across_byte_tokens_is_emitted_once_complete(tok):
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1 and REPLACEMENT_CHAR in tok.decode(ids[:1])  # really split over tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed([i]) for i in ids]
    assert deltas[:-1] == [" "] + [""] * (len(ids) - 2)  # the space may go out, the emoji waits
    assert deltas[-1] == "😀"
    assert detok.finish(LENGTH) == ""


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_ids_stream_equals_full_decode(tok, partial_ids, data):
    # Mostly split-character byte tokens, so incomplete and invalid sequences are common.
    token = st.one_of(st.sampled_from(partial_ids), st.integers(0, len(tok) - 1), st.sampled_from([0, 1, 2]))
    ids = data.draw(st.lists(token, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    skip = data.draw(st.booleans())
    deltas = stream(tok, ids, chunks, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert_streamed_prefixes(deltas, full)
    # Before finish nothing ends in U+FFFD: an incomplete character is always held back.
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1])


def test_skip_special_tokens_decides_whether_eos_text_shows(tok):
    ids = tok.encode("Done.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    stop_token = {"type": "stop", "matched": ids[-1]}
    assert "".join(stream(tok, ids, finish=stop_token, skip_special_tokens=False)) == "Done.<|im_end|>"
    assert "".join(stream(tok, ids, finish=stop_token, skip_special_tokens=True)) == "Done."


def test_stop_string_split_across_tokens_is_never_streamed_and_trimmed(tok):
    text = "The answer is 42.\n\nUser: what next"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "\n\nUser:"
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop string spans tokens
    deltas, full, matched = stream_until_stop(tok, ids, [stop])
    assert matched == stop
    assert_streamed_prefixes(deltas, full[:full.find(stop)])
    assert "".join(deltas) == "The answer is 42."
    # Before finish the client saw no piece of the stop string, not even its leading newlines.
    assert "".join(deltas[:-1]) == "The answer is 42."
    assert deltas[-1] == ""


def test_no_stop_trim_keeps_the_stop_string(tok):
    ids = tok.encode("x = 1 END_OF_ANSWER y", add_special_tokens=False)
    deltas, full, matched = stream_until_stop(tok, ids, ["END_OF_ANSWER"], no_stop_trim=True)
    assert matched == "END_OF_ANSWER"
    assert_streamed_prefixes(deltas, full)
    assert full.endswith("END_OF_ANSWER")


def test_held_back_text_is_released_when_it_can_no_longer_be_a_stop(tok):
    ids = tok.encode("a ## b ### c", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["###"])
    seen = [detok.feed([i]) for i in ids]
    streamed = "".join(seen)
    assert "##" in streamed  # the lone "##" went out once " b" ruled it out
    assert "###" not in streamed and not streamed.endswith("#")
    assert detok.finish({"type": "stop", "matched": "###"}) == ""
    assert streamed == "a ## b "


def test_length_finish_releases_a_held_stop_prefix(tok):
    ids = tok.encode("ends with ##", add_special_tokens=False)
    deltas = stream(tok, ids, stop=["###"])
    assert "".join(deltas[:-1]) == "ends with "
    assert deltas[-1] == "##"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_stop_strings_match_trimmed_full_decode(tok, data):
    text = data.draw(st.sampled_from(TEXTS))
    start = data.draw(st.integers(1, len(text) - 2))
    stop = text[start:start + data.draw(st.integers(1, 6))]  # often spans token boundaries
    decoy = data.draw(st.text(alphabet="ab😀 ", min_size=1, max_size=3))
    ids = tok.encode(text, add_special_tokens=False)
    deltas, full, matched = stream_until_stop(tok, ids, [decoy, stop])
    final = full[:full.find(matched)] if matched is not None else full
    assert_streamed_prefixes(deltas, final)


def stream_until_regex(tok, ids: Sequence[int], patterns: list[str], no_stop_trim: bool = False):
    """Plays the scheduler for stop regexes: one id per step, finishing at the first step whose
    decoded output matches a pattern. Returns (deltas, the full decoded output, the match)."""
    detok = IncrementalDetokenizer(tok, stop_regex=patterns, no_stop_trim=no_stop_trim)
    deltas = []
    for n in range(1, len(ids) + 1):
        deltas.append(detok.feed(ids[n - 1:n]))
        full = tok.decode(ids[:n], skip_special_tokens=True)
        found = next((m for m in (regex.search(p, full) for p in patterns) if m), None)
        if found is not None:
            deltas.append(detok.finish({"type": "stop", "matched": found.group(0)}))
            return deltas, full, found.group(0)
    deltas.append(detok.finish(LENGTH))
    return deltas, tok.decode(ids, skip_special_tokens=True), None


@pytest.mark.parametrize("text, pattern, matched", [
    ("Count: 5, 6, 7, 8", r" [7-9]", " 7"),
    ("The answer is 42.\n\nUser: what next", r"\n\n\w+:", "\n\nUser:"),
    ("Hello 😀 wörld 你好, naïve café — ok?", r"c\w+é", "café"),
    ("total = 1234 units", r"(?<== )\d{3}", "123"),  # the lookbehind reaches into emitted text
    ("x = 1 END_OF_ANSWER y", r"END_OF_\w+|never", "END_OF_AN"),
])
def test_stop_regex_match_is_never_streamed_and_trimmed(tok, text, pattern, matched):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, full, found = stream_until_regex(tok, ids, [pattern])
    assert found == matched
    # What the client saw was at every step a prefix of the non-streamed text (cut at the match).
    assert_streamed_prefixes(deltas, full[:full.find(found)])
    kept, full, _ = stream_until_regex(tok, ids, [pattern], no_stop_trim=True)
    assert_streamed_prefixes(kept, full)


def test_text_that_can_no_longer_match_a_stop_regex_is_released(tok):
    detok = IncrementalDetokenizer(tok, stop_regex=[r"\d+ units"])
    seen = [detok.feed([i]) for i in tok.encode("about 12 apples and 7 units", add_special_tokens=False)]
    assert "".join(seen[:4]) == "about "  # "about", " ", "1", "2": the digits may start a match
    assert "".join(seen) == "about 12 apples and "  # " apples" ruled "12" out; "7 units" is held
    assert detok.finish({"type": "stop", "matched": "7 units"}) == ""


def test_a_stop_regex_that_times_out_holds_everything_until_finish(tok):
    ids = tok.encode("a" * 40, add_special_tokens=False)
    deltas = stream(tok, ids, stop_regex=[r"(a|aa)+b"])  # backtracks exponentially
    assert deltas[:3] == ["", "", ""] and "".join(deltas) == "a" * 40


def test_each_step_decodes_a_small_window(tok):
    class CountingTokenizer:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, **kwargs)

    counting = CountingTokenizer()
    ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    deltas = stream(counting, ids, stop=["never appears"])
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 1000 and counting.longest <= 8  # not the whole output


def test_tokenizer_without_spaces_between_special_tokens_kwarg():
    class StrictTokenizer:  # a decode with a fixed signature, like some slow tokenizers
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    detok = IncrementalDetokenizer(StrictTokenizer(), spaces_between_special_tokens=False)
    assert detok.feed([0, 1]) + detok.feed([2]) + detok.finish(LENGTH) == "abc"


def _req_output(rid: str, ids: list[int], finish: dict | None, **options: Any) -> ReqOutput:
    return ReqOutput(rid=rid, new_token_ids=ids, finish_reason=finish, prompt_tokens=3,
                     completion_tokens=len(ids), cached_tokens=0, **options)


def test_manager_keeps_state_per_rid_and_drops_it_at_finish(tok):
    manager = DetokenizerManager(tok)
    a = tok.encode(" Hello 😀 world", add_special_tokens=False)
    b = tok.encode(" 你好", add_special_tokens=False)
    texts = {"a": "", "b": ""}
    steps = max(len(a), len(b))
    for n in range(steps):
        outs = [_req_output(rid, ids[n:n + 1], LENGTH if n == len(ids) - 1 else None)
                for rid, ids in (("a", a), ("b", b)) if n < len(ids)]
        reply = manager.handle(BatchTokenOut(outputs=outs))
        assert isinstance(reply, BatchTextOut)
        assert [r.output for r in reply.outputs] == outs
        for r in reply.outputs:
            texts[r.rid] += r.text_delta
    assert texts == {"a": " Hello 😀 world", "b": " 你好"}
    assert manager.states == {}
    control = ControlReply(request_id="c1", ok=True, data={"x": 1})
    assert manager.handle(control) is control


def test_manager_survives_a_bad_request(tok):
    manager = DetokenizerManager(tok)
    reply = manager.handle(BatchTokenOut(outputs=[_req_output("bad", [-1], None),
                                                  _req_output("ok", [19556], LENGTH)]))
    assert [(r.rid, r.text_delta) for r in reply.outputs] == [("bad", ""), ("ok", "Hello")]
    assert manager.states == {}


def _recv(sock: zmq.Socket, timeout_ms: int) -> Any:
    assert sock.poll(timeout_ms), "no message from the detokenizer process"
    return io_struct.decode(sock.recv())


def test_detokenizer_process_over_ipc(tok, default_model):
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="radixlm-detok-") as run_dir:
        os.chmod(run_dir, 0o700)
        recv_addr, send_addr, ready_addr = (f"ipc://{run_dir}/{name}" for name in ("detok", "tm", "ready"))
        ready = ctx.socket(zmq.PULL)
        ready.bind(ready_addr)
        from_detok = ctx.socket(zmq.PULL)
        from_detok.bind(send_addr)
        to_detok = ctx.socket(zmq.PUSH)
        to_detok.connect(recv_addr)
        for sock in (ready, from_detok, to_detok):
            sock.setsockopt(zmq.LINGER, 0)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_detokenizer_process, args=(default_model.local_dir, recv_addr, send_addr, ready_addr))
        proc.start()
        try:
            signal_msg = _recv(ready, 120_000)
            assert signal_msg == ReadySignal(process="detokenizer", ok=True)

            ids = tok.encode(" Hi 😀!", add_special_tokens=False)
            to_detok.send(b"not msgpack")  # logged and skipped
            to_detok.send(io_struct.encode(BatchTokenOut(outputs=[_req_output("r1", ids[:2], None)])))
            to_detok.send(io_struct.encode(BatchTokenOut(outputs=[_req_output("r1", ids[2:], LENGTH)])))
            control = ControlReply(request_id="c1", ok=True, data={"cached": 0})
            to_detok.send(io_struct.encode(control))

            first, second = _recv(from_detok, 10_000), _recv(from_detok, 10_000)
            assert isinstance(first, BatchTextOut) and isinstance(second, BatchTextOut)
            assert first.outputs[0].text_delta + second.outputs[0].text_delta == " Hi 😀!"
            assert second.outputs[0].output.finish_reason == LENGTH
            assert _recv(from_detok, 10_000) == control

            proc.terminate()
            proc.join(10)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
            for sock in (ready, from_detok, to_detok):
                sock.close()
            ctx.term()


def test_detokenizer_process_reports_a_failed_start():
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="radixlm-detok-") as run_dir:
        os.chmod(run_dir, 0o700)
        ready = ctx.socket(zmq.PULL)
        ready.setsockopt(zmq.LINGER, 0)
        ready.bind(f"ipc://{run_dir}/ready")
        proc = multiprocessing.get_context("spawn").Process(target=run_detokenizer_process, args=(
            f"{run_dir}/no-such-tokenizer", f"ipc://{run_dir}/detok", f"ipc://{run_dir}/tm", f"ipc://{run_dir}/ready"))
        proc.start()
        try:
            signal_msg = _recv(ready, 120_000)
            assert signal_msg.process == "detokenizer" and not signal_msg.ok
            assert "no-such-tokenizer" in signal_msg.error
            proc.join(10)
            assert proc.exitcode == 1
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
            ready.close()
            ctx.term()


# ---------------------------------------------------------------- the process's decoder

def _tokenizer_dirs(default_model) -> list[str]:
    return [default_model.local_dir, str(convert_gguf_tokenizer(LLAMA3_TOKENIZER_GGUF))]


def test_the_process_decodes_through_tokenizers_exactly_as_transformers(default_model):
    """The detokenizer process decodes through the `tokenizers` library (no transformers, so no
    torch to import at start) where that is exact: for GGUF-converted tokenizers such as the
    default model's and Llama 3's, random ids (special ones included) decode as transformers'
    tokenizer decodes them, with and without skip_special_tokens."""
    rng = random.Random(0)
    for directory in _tokenizer_dirs(default_model):
        decoder, hf = load_decoder(directory), load_tokenizer(directory)
        assert isinstance(decoder, RustDecoder), directory
        special = list(hf.all_special_ids)
        samples = [hf.encode(text, add_special_tokens=False) for text in TEXTS]
        samples += [[rng.choice(special) if rng.random() < 0.15 else rng.randrange(len(hf))
                     for _ in range(rng.randrange(1, 40))] for _ in range(300)]
        for ids in samples:
            for skip in (True, False):
                assert decoder.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True) == \
                    hf.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True), (directory, ids)


@pytest.mark.parametrize("change", ["clean_up", "model_class", "unmarked_special", "added_token_differs", "no_class"])
def test_the_process_decodes_through_transformers_where_tokenizers_would_differ(change, tmp_path, default_model):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model.local_dir) / name, tmp_path / name)
    assert isinstance(rust_decoder(str(tmp_path)), RustDecoder)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if change == "clean_up":
        config["clean_up_tokenization_spaces"] = True
    elif change == "model_class":
        config["tokenizer_class"] = "LlamaTokenizer"
    elif change == "unmarked_special":
        config["additional_special_tokens"] = ["hello"]  # an ordinary vocabulary entry
    elif change == "added_token_differs":
        config["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "special": False}}
    else:
        del config["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert rust_decoder(str(tmp_path)) is None
    if change != "model_class":  # LlamaTokenizer would need this model's sentencepiece files
        assert not isinstance(load_decoder(str(tmp_path)), RustDecoder)


def test_the_process_starts_without_importing_torch_or_transformers(default_model):
    code = ("import sys; from radixlm.srt.entrypoints.detokenizer import run_detokenizer_process; "
            "from radixlm.srt.detokenizer.text_decoder import load_decoder; "
            f"d = load_decoder({default_model.local_dir!r}); assert d.decode([28, 80]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
