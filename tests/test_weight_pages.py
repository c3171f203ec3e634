"""Weights moved onto transparent huge pages: the same numbers, ties and checkpoint, on
memory the kernel was asked to back with huge pages."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from djl_stream.runtime.runner import Feed, RunnerSettings, load_runner
from djl_stream.runtime.weight_pages import huge_page_mode, move_weights_to_huge_pages

THP_ON = huge_page_mode() in ("always", "madvise")


def model(tied=True):
    torch.manual_seed(0)
    # (a 4096-token vocabulary of width 256: a 4 MB embedding, more than one huge page)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def vm_flags(address: int) -> list:
    """The kernel's flags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def logits(m):
    with torch.inference_mode():
        return m(torch.tensor([[1, 2, 3, 4, 5]])).logits


@pytest.mark.skipif(not THP_ON, reason="the kernel's transparent huge pages are off here")
def test_weights_move_onto_memory_advised_for_huge_pages_and_compute_the_same():
    m = model()
    before = logits(m)
    parameters = list(m.parameters())
    moved = move_weights_to_huge_pages(m)
    assert moved.bytes == sum(p.numel() * p.element_size() for p in parameters)
    assert list(m.parameters()) == parameters  # (the same Parameter objects)
    assert torch.equal(logits(m), before)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    for parameter in parameters:
        # "hg": the mapping was advised with MADV_HUGEPAGE
        assert "hg" in vm_flags(parameter.data_ptr()), parameter.shape
        assert parameter.data_ptr() % 64 == 0


@pytest.mark.skipif(not THP_ON, reason="the kernel's transparent huge pages are off here")
def test_moved_weights_save_as_a_checkpoint_that_loads_back(tmp_path):
    # save_pretrained tells tensors apart by their storage: each weight keeps its own
    m = model(tied=False)
    move_weights_to_huge_pages(m)
    m.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(again), logits(m))


def test_nothing_moves_where_the_kernel_gives_no_huge_pages():
    m = model()
    where = [p.data_ptr() for p in m.parameters()]
    moved = move_weights_to_huge_pages(m, mode="never")
    assert moved.bytes == 0 and "never" in moved.reason
    assert [p.data_ptr() for p in m.parameters()] == where


def test_weights_smaller_than_a_huge_page_stay_where_they_are():
    m = torch.nn.Linear(16, 16)
    where = m.weight.data_ptr()
    moved = move_weights_to_huge_pages(m, mode="madvise")
    assert moved.bytes == 0 and "smaller than one huge page" in moved.reason
    assert m.weight.data_ptr() == where


@pytest.mark.skipif(not THP_ON, reason="the kernel's transparent huge pages are off here")
def test_the_runner_serves_from_weights_it_moved():
    m = model()
    before = logits(m)
    runner = load_runner(m, RunnerSettings(max_rows=2, max_positions=64))
    assert "hg" in vm_flags(m.model.embed_tokens.weight.data_ptr())
    handle = runner.reserve()
    served = runner.run([Feed(handle, [1, 2, 3, 4, 5])])
    torch.testing.assert_close(served[0], before[0, -1], rtol=1e-4, atol=1e-4)


def test_weights_stay_where_a_copy_beside_them_would_crowd_the_memory_available():
    m = model()
    where = [p.data_ptr() for p in m.parameters()]
    size = sum(p.numel() * p.element_size() for p in m.parameters())
    moved = move_weights_to_huge_pages(m, mode="madvise", available=size)
    assert moved.bytes == 0 and "half of the memory available" in moved.reason
    assert [p.data_ptr() for p in m.parameters()] == where
