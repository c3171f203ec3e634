"""The parts of ``make bench-peers`` that decide its figures: reading each server's stream,
the targets computed from the rows, the BENCHMARKS.md section that ``make bench``
keeps, and the pausing of the servers not being measured. (The peers themselves are installed and run by ``make bench-peers`` only.)"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.http_load import LoadResult, StreamError
from benchmarks.measure import StreamTiming
from benchmarks.measure import process_tree
from benchmarks.peers.run import Paused, PeerResult, targets
from benchmarks.report import WHY_MISSED
from benchmarks.sections import kept_sections, markers, write_section
from benchmarks.peers.servers import PEERS, openai_completion_pieces, text_chunks


def response(body: bytes) -> httpx.Response:
    return httpx.Response(200, content=body, request=httpx.Request("POST", "http://peer"))


def test_an_openai_completion_stream_yields_each_event_s_text_until_done():
    events = [{"choices": [{"text": "Hello"}]}, {"choices": [{"text": ""}]},
              {"choices": [{"text": " world"}]}, {"choices": []}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    body += 'data: {"choices": [{"text": "after done"}]}\n\n'
    assert list(openai_completion_pieces(response(body.encode()))) == ["Hello", " world"]


def test_an_error_event_in_the_stream_is_a_stream_error():
    body = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
    pieces = openai_completion_pieces(response(body))
    assert next(pieces) == "a"
    try:
        next(pieces)
    except StreamError as error:
        assert "boom" in str(error)
    else:
        raise AssertionError("the error event was not raised")


def test_a_plain_text_stream_yields_its_chunks():
    assert "".join(text_chunks(response("Ave, Roma 🏛️".encode()))) == "Ave, Roma 🏛️"


def _load(clients: int, gap: float) -> LoadResult:
    """``clients`` streams of 10 tokens, one every ``gap`` seconds: an ITL of ``gap`` and
    ``clients / gap`` tokens/s together."""
    arrivals = tuple(i * gap for i in range(1, 11))
    return LoadResult(clients, (StreamTiming(0.0, arrivals, arrivals[-1], 10),) * clients)


def _result(name: str, solo_itl: float, tokens_per_s_at_16: float) -> PeerResult:
    return PeerResult(PEERS[name], loads={1: [_load(1, solo_itl)],
                                          16: [_load(16, 16 / tokens_per_s_at_16)]})


def test_the_targets_are_ratios_of_the_rows_and_say_by_how_much_one_is_missed():
    args = argparse.Namespace(clients=[1, 16])
    results = {"djl-stream": _result("djl-stream", 0.030, 160.0),
               "djl-stream eager": _result("djl-stream eager", 0.040, 150.0),
               "llama-server F32": _result("llama-server F32", 0.025, 100.0),
               "llama-server Q8_0": _result("llama-server Q8_0", 0.015, 120.0),
               "llama.cpp F32": _result("llama.cpp F32", 0.024, 30.0),
               "transformers serve": _result("transformers serve", 0.060, 100.0),
               "djl-stream w8a8": _result("djl-stream w8a8", 0.018, 200.0)}
    lines = targets(results, args)
    expected = {
        0: "**FAIL** djl-stream single-stream ITL p50 <= 1.0x llama-server F32's: 1.20x "
           "(missed by 20%); 30.0 ms vs 25.0 ms",
        1: "**FAIL** djl-stream eager single-stream ITL p50 <= 1.0x llama-server F32's: 1.60x",
        2: "**PASS** djl-stream aggregate tokens/s at 16 clients >= 1.5x llama-server F32's "
           "(--parallel): 1.60x; 160.0 vs 100.0 tokens/s",
        3: "**NOT MEASURED** djl-stream int8 single-stream ITL p50 <= 1.0x llama-server Q8_0's",
        4: "**FAIL** djl-stream single-stream ITL p50 <= 1.15x llama.cpp F32's "
           "(llama-cpp-python): 1.25x (missed by 9%)",
        # each float32 server's throughput against each peer's
        6: "**PASS** djl-stream aggregate tokens/s at 16 clients >= 1.5x transformers "
           "serve's: 1.60x",
        7: "**PASS** djl-stream eager aggregate tokens/s at 16 clients >= 1.5x transformers "
           "serve's: 1.50x",
        8: "**PASS** djl-stream aggregate tokens/s at 16 clients >= 4.0x llama.cpp F32's: 5.3",
        10: "**NOT MEASURED** djl-stream int8 single-stream",
        11: "**PASS** djl-stream w8a8 single-stream >= 1.6x our float32 (djl-stream, ITL "
            "p50): 1.67x",
    }
    for index, prefix in expected.items():
        assert lines[index].startswith(prefix), (index, lines[index])
    assert len(lines) == 12


def test_a_section_replaces_its_old_self_and_make_bench_keeps_them_in_their_order(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nmake bench's part\n", encoding="utf-8")
    write_section(path, "quantization", "first")
    write_section(path, "peers", "peers' figures")
    write_section(path, "quantization", "second")
    text = path.read_text(encoding="utf-8")
    begin, end = markers("quantization")
    assert text.count(begin) == 1 and "second" in text and "first" not in text
    assert text.startswith("# Benchmarks\n\nmake bench's part\n")
    # make bench rewrites the rest and puts the sections back, in the order they were in
    assert kept_sections(path) == [f"{begin}\nsecond\n{end}",
                                   "<!-- peers -->\npeers' figures\n<!-- /peers -->"]
    assert kept_sections(tmp_path / "none.md") == []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_paused_stops_a_server_s_whole_process_tree_and_resumes_it_even_after_an_error():
    # a "server" with a child process, as Ray's driver has its raylet and workers
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               "child = subprocess.Popen([sys.executable, '-c', "
                               "'import time\\nwhile True: time.sleep(0.01)'])\n"
                               "print(child.pid, flush=True)\n"
                               "while True: time.sleep(0.01)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        server = types.SimpleNamespace(pid=parent.pid)
        with pytest.raises(RuntimeError):
            with Paused([server]) as paused:
                assert sorted(paused.stopped) == sorted([parent.pid, child])
                for pid in (parent.pid, child):
                    for _ in range(200):  # SIGSTOP is delivered asynchronously
                        if _state(pid) == "T":
                            break
                        time.sleep(0.01)
                    assert _state(pid) == "T"
                raise RuntimeError("a row that fails")
        assert paused.stopped == []
        for pid in (parent.pid, child):
            for _ in range(200):
                if _state(pid) != "T":
                    break
                time.sleep(0.01)
            assert _state(pid) != "T"
        with Paused([]) as nothing:  # --keep-others-running
            assert nothing.stopped == []
    finally:
        for pid in process_tree(parent.pid)[::-1]:
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_a_djl_stream_peer_s_options_reach_its_server_even_where_serving_properties_sets_them(
        tmp_path):
    model_dir = Path(__file__).resolve().parent.parent / "model"
    # model/ leaves option.dtype to the environment: OPTION_DTYPE carries it
    plain = PEERS["djl-stream bf16"].server(model_dir, tmp_path, {}, tmp_path / "plain")
    assert Path(plain.command()[plain.command().index("serve") + 1]) == model_dir
    assert plain.env["OPTION_DTYPE"] == "bf16"
    # a directory whose file sets option.dtype (which wins over OPTION_DTYPE): a copy that
    # says bf16, its other files those of the directory
    pinned = tmp_path / "pinned"
    pinned.mkdir()
    for name in ("model.py", "config.json"):
        (pinned / name).symlink_to(model_dir / name)
    (pinned / "serving.properties").write_text("engine=Python\noption.dtype=fp32\n")
    bf16 = PEERS["djl-stream bf16"].server(pinned, tmp_path, {}, tmp_path / "bf16")
    served = Path(bf16.command()[bf16.command().index("serve") + 1])
    assert served != pinned
    assert "option.dtype=bf16\n" in (served / "serving.properties").read_text()
    assert (served / "config.json").resolve() == (model_dir / "config.json").resolve()
    # the file does not set option.quantize: the environment carries it, as SageMaker's does
    int8 = PEERS["djl-stream int8"].server(model_dir, tmp_path, {}, tmp_path / "int8")
    assert Path(int8.command()[int8.command().index("serve") + 1]) == model_dir
    assert int8.env["OPTION_QUANTIZE"] == "int8"


def test_the_reports_link_to_a_section_that_exists():
    # BENCHMARKS.md's target lists send the reader to it: GitHub's anchor of a heading is
    # its text in lower case, punctuation dropped, spaces as hyphens
    document, anchor = WHY_MISSED.split("#")
    text = (Path(__file__).resolve().parent.parent / document).read_text()
    anchors = [re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
               for line in text.splitlines() if line.startswith("#")]
    assert anchor in anchors


def test_device_puts_transformers_serve_on_the_gpu_in_djl_stream_s_dtype_and_cpu_hides_it(
        tmp_path):
    model_dir = Path(__file__).resolve().parent.parent / "model"
    peer = PEERS["transformers serve"]
    on_gpu = peer.server(model_dir, tmp_path, {}, tmp_path / "gpu", device="cuda",
                         installed=True)
    command = on_gpu.command()
    # --installed: this interpreter, not an environment under .peers/
    assert command[0] == sys.executable
    # djl-stream's own rule for option.dtype=auto on a GPU (bfloat16 where the GPU has it,
    # float16 else; this machine has no GPU to ask): both servers read the same weights
    assert command[command.index("--device") + 1] == "cuda"
    assert command[command.index("--dtype") + 1] == (
        "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    assert "CUDA_VISIBLE_DEVICES" not in on_gpu.env
    # and the report says so: its rows on a GPU read bfloat16, not the CPU's float32
    for name in ("transformers serve", "djl-stream", "djl-stream eager"):
        assert PEERS[name].weights_on("cuda").startswith("bfloat16"), name
        assert PEERS[name].weights_on("cpu").startswith("float32"), name
    on_cpu = peer.server(model_dir, tmp_path, {}, tmp_path / "cpu")
    command = on_cpu.command()
    assert command[0] == str(tmp_path / "transformers-serve" / "bin" / "python")
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--dtype") + 1] == "float32"
    # a machine with a GPU as well: djl-stream, which takes a GPU where it sees one, too
    assert on_cpu.env["CUDA_VISIBLE_DEVICES"] == ""
    assert PEERS["djl-stream"].server(model_dir, tmp_path, {}, tmp_path / "ours"
                                      ).env["CUDA_VISIBLE_DEVICES"] == ""
    # a model directory that names its dtype: transformers serve reads it in that one too
    fp16_dir = tmp_path / "fp16-model"
    fp16_dir.mkdir()
    (fp16_dir / "serving.properties").write_text("option.dtype=fp16\n")
    for device in ("cpu", "cuda"):
        command = peer.server(fp16_dir, tmp_path, {}, tmp_path / f"fp16-{device}",
                              device=device).command()
        assert command[command.index("--dtype") + 1] == "float16"
