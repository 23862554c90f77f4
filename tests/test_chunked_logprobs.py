"""Log-probs in chunks (#41, `megatron.chunked_logprobs`): the output layer and Megatron's cross-entropy a
few tokens at a time give the per-token losses, the entropy and the gradients of the whole computation,
and save less for the backward by the whole row's fp32 logits (the softmax, the entropy's).

One real gloo rank, a tiny GPTModel in fp32 on a packed row: the same forward (at T = 0.7, with the
entropy captured) and the backward of a fixed functional of the losses and the entropies, with whole logits
(Megatron's own path, the reference) and in chunks of 1, 7 and more tokens than the row. Memory: the bytes
of the tensors autograd saves for the backward (unique storages, parameters excluded; a saved-tensor hook
outside the checkpointed chunks, which save nothing of their own). Control: the chunks ignoring the
temperature differ.
"""

from __future__ import annotations

import pytest
import torch

from .distributed_harness import run_distributed
from .megatron_workers import VOCAB

LENGTHS = [37, 5, 60, 18]
CHUNKS = [1, 7, 1000]


def _saved_bytes(run, params: set) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs (parameters excluded)."""
    storages: dict = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(storages.values())


def chunked_worker(rank, world_size, lengths, chunks):
    from mcore_packing.megatron import (
        chunk_logprobs,
        cpu_device_adapter,
        get_packed_gpt_layer_spec,
        logits_temperature,
        to_packed_seq_params,
    )
    from mcore_packing.megatron.entropy import capture_entropy
    from mcore_packing.megatron.output_layer import DeferredLogits
    from mcore_packing.thd import SequenceSample, build_packed_batch

    from .megatron_workers import _grads, build_tiny_gpt, init_megatron

    init_megatron()
    generator = torch.Generator().manual_seed(41)
    samples = [SequenceSample(torch.randint(0, VOCAB, (n,), generator=generator)) for n in lengths]
    batch = build_packed_batch(samples)
    weights = torch.randn(batch.labels.shape, generator=generator)
    entropy_weights = torch.randn(batch.labels.shape, generator=generator)
    out = {"tokens": batch.total_tokens}
    with cpu_device_adapter():
        model = build_tiny_gpt(get_packed_gpt_layer_spec("local"), seed=0)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def step(chunk=None):
            model.zero_grad(set_to_none=True)
            installed = chunk_logprobs(model, chunk) if chunk is not None else None
            try:
                with logits_temperature(model, 0.7), capture_entropy(model, None, 16) as capture:
                    forward = lambda: model(batch.tokens, batch.position_ids, None, labels=batch.labels,  # noqa: E731
                                            packed_seq_params=to_packed_seq_params(batch))  # fmt: skip
                    loss, saved = _saved_bytes(forward, params)
                    entropy = capture.pop()
                ((loss * weights).sum() + (entropy * entropy_weights).sum()).backward()
            finally:
                if installed is not None:
                    installed.undo()
            return {"loss": loss.detach(), "entropy": entropy.detach(), "grads": _grads(model), "saved": saved}

        out["whole"] = step()
        out["chunked"] = {chunk: step(chunk) for chunk in chunks}
        real_scaled = DeferredLogits.scaled
        DeferredLogits.scaled = lambda self, factor: self  # control: the chunks ignore the temperature
        try:
            out["no_temperature"] = step(chunks[1])
        finally:
            DeferredLogits.scaled = real_scaled
        with chunk_logprobs(model, 7), pytest.raises(RuntimeError) as raised:
            model(batch.tokens, batch.position_ids, None, packed_seq_params=to_packed_seq_params(batch))
        out["no_labels"] = str(raised.value)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.test_chunked_logprobs:chunked_worker", 1, lengths=LENGTHS, chunks=CHUNKS)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _changes(got: dict, want: dict) -> tuple[float, float, float]:
    grads = max(_rel(got["grads"][name], want["grads"][name]) for name in want["grads"])
    assert got["grads"].keys() == want["grads"].keys()
    return _rel(got["loss"], want["loss"]), _rel(got["entropy"], want["entropy"]), grads


@pytest.mark.multirank
def test_chunks_give_the_whole_logits_losses_entropy_and_gradients(results):
    whole = results["whole"]
    worst = [max(values) for values in zip(*(_changes(r, whole) for r in results["chunked"].values()), strict=True)]
    control = _changes(results["no_temperature"], whole)
    print(f"chunks of {CHUNKS} tokens vs whole logits: per-token losses {worst[0]:.1e}, entropy {worst[1]:.1e}, "
          f"gradients {worst[2]:.1e}; control (temperature ignored): losses {control[0]:.1e}")  # fmt: skip
    assert max(worst) <= 1e-6
    assert control[0] > 1e-3 and control[2] > 1e-3
    assert "chunked log-probs (model.logprob_chunk_size)" in results["no_labels"]


@pytest.mark.multirank
def test_chunks_save_less_for_the_backward_by_the_rows_fp32_softmax(results):
    """Predicted: the whole path keeps the row's fp32 logits twice, T x V x 4 bytes each (the cross-entropy's
    softmax, and the logits the entropy saves), and the cross-entropy's target mask and ids (T x 9 bytes);
    the chunks keep none of it."""
    tokens = results["tokens"]
    predicted = 2 * tokens * VOCAB * 4 + tokens * 9
    whole = results["whole"]["saved"]
    for chunk, result in results["chunked"].items():
        saved_less = whole - result["saved"]
        print(f"chunks of {chunk}: saved for the backward {result['saved']:,} B vs {whole:,} B whole: {saved_less:,} B "
              f"less, predicted {predicted:,} B")  # fmt: skip
        assert abs(saved_less - predicted) <= 0.05 * predicted
