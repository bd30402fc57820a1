"""StaticKVCache's CPU decode attention against the SDPA reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from ember.ops.attention import causal_mask, grouped_decode_attention, sdpa_attention
from tests.conftest import run_cached, tiny_random_model


@pytest.mark.parametrize(("H", "K", "window"), [(9, 3, None), (4, 4, None), (8, 2, 5)])
def test_decode_attention_matches_sdpa(H, K, window):
    torch.manual_seed(0)
    B, S, D = 2, 16, 32
    q = torch.randn(B, 1, H, D)  # (B, 1, H, D)
    k = torch.randn(B, K, S, D)  # (B, K, S, D)
    v = torch.randn(B, K, S, D)
    positions = torch.tensor([[3], [11]])  # rows at different positions
    mask = causal_mask(positions, torch.arange(S)[None], window)  # (B, 1, 1, S)
    ref = sdpa_attention(q.transpose(1, 2), k, v, mask, scale=D**-0.5).transpose(1, 2)
    out = grouped_decode_attention(q, k, v, mask, D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_a_prompt_from_slot_0_attends_over_its_own_slots_as_over_all_of_them(window, monkeypatch):
    """A `prompts_from_start` cache attends a prompt over its T slots (causal, masked where a sliding window
    hides part of it: T just above the window is the edge) and gives what the full S-slot mask gives, then
    and in the decode steps after it."""
    model = tiny_random_model(monkeypatch, window)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for T in (2, 5, 6, 7, 8):
            whole, own = (
                run_cached(model, ids, T, max_seq_len=32, prompts_from_start=f) for f in (False, True)
            )
            torch.testing.assert_close(own, whole, atol=1e-5, rtol=1e-5)


def test_an_eager_cpu_decode_step_runs_the_fused_kernels():
    # Each layer of an eager CPU decode step: its rope, cache writes and attention in one call, its norms in
    # C++ (the fused ops' values are tested in tests/ops); a prompt's rope and writes in one call too.
    from ember.bench import random_model
    from ember.engine.generate import Generator
    from ember.engine.sampler import SamplingParams
    from ember.ops import cpu_ext

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    gen = Generator(model, device=torch.device("cpu"), context=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with torch.profiler.profile() as prof:
        list(gen.generate([5, 6, 7], params, (), None))
    calls = [e.name for e in prof.events()]
    layers = model.config.num_layers
    assert calls.count("ember_cpu::rope_decode_attention") == 3 * layers  # 3 decode steps after the prompt
    assert calls.count("ember_cpu::add_rms_norm") >= 3 * (2 * layers - 1)
    assert calls.count("ember_cpu::rope_prompt_write") == layers  # the prompt's
    assert calls.count("aten::index_put_") == 0
