"""`prompt_attention` against the whole mask: a prompt's queries over the keys they can see, in chunks or not."""

from __future__ import annotations

import pytest
import torch

from ember.ops import attention
from ember.ops.attention import causal_mask, prompt_attention, sdpa_attention


def whole_mask_attention(q, k, v, window, scale, softcap):
    T, S = q.shape[2], k.shape[2]
    positions = torch.arange(S, device=q.device)[None]
    mask = causal_mask(positions[:, S - T :], positions, window)  # (1, 1, T, S)
    return sdpa_attention(q, k, v, mask, scale=scale, softcap=softcap)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(
    "device,cpu_kernel", [("cpu", True), ("cpu", False), pytest.param("cuda", False, marks=CUDA)]
)
@pytest.mark.parametrize("chunk", [16, attention.PROMPT_CHUNK])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize(
    "T,S,window",
    [
        (70, 70, None),  # from position 0, causal: one call
        (70, 70, 70),  # a window that hides nothing
        (70, 70, 9),  # a window that cuts the prompt: a band of keys
        (70, 70, 69),  # the window's edge
        (21, 90, None),  # after a cached prefix
        (21, 90, 30),  # after a prefix, and the window starts inside it
        (5, 90, 4),  # fewer queries than the window
        (300, 300, 40),  # chunks of the real size too
    ],
)
def test_a_prompt_sees_what_the_whole_mask_shows(
    monkeypatch, device, cpu_kernel, chunk, softcap, T, S, window
):
    """On a CPU, through Ember's kernel where it runs (AVX-512; no soft-cap) and through SDPA."""
    monkeypatch.setattr(attention, "PROMPT_CHUNK", chunk)
    monkeypatch.setattr(attention, "CPU_KERNEL", cpu_kernel)
    torch.manual_seed(T + S)
    B, H, K, D = 2, 6, 2, 32
    q = torch.randn(B, H, T, D, device=device)
    k, v = torch.randn(B, K, S, D, device=device), torch.randn(B, K, S, D, device=device)
    got = prompt_attention(q, k, v, window=window, scale=D**-0.5, softcap=softcap)
    want = whole_mask_attention(q, k, v, window, D**-0.5, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def keys_seen(monkeypatch) -> list[int]:
    """Chunks of 8 query rows, and the number of keys each SDPA call of `prompt_attention` is handed (SDPA's
    path: not Ember's CPU kernel)."""
    monkeypatch.setattr(attention, "PROMPT_CHUNK", 8)
    monkeypatch.setattr(attention, "CPU_KERNEL", False)
    seen: list[int] = []
    real = attention.sdpa_attention

    def counting(q, k, v, mask, **kw):
        seen.append(k.shape[2])
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(attention, "sdpa_attention", counting)
    return seen


def test_chunks_read_only_the_keys_their_queries_see(keys_seen):
    """The work a window saves: each chunk of queries is handed only the keys from the first one it sees."""
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    prompt_attention(q, k, v, window=4, scale=0.25)
    # chunk [a, a + 8) sees keys from a - 3 to a + 7: 11 keys (8 for the first)
    assert keys_seen == [8, 11, 11, 11, 11]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_compiled_prompt_goes_through_its_window_in_chunks(keys_seen, device):
    """Compiled with dynamic shapes (as `--compile-prefill` compiles a prompt), a window shorter than the prompt
    is one op of the graph that runs the chunks: the eager answer, each chunk over only its band, for two
    prompt lengths from one graph."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: prompt_attention(q, k, v, window=4, scale=0.25) * 2, dynamic=True, fullgraph=True
    )
    for T in (40, 43):
        q, k, v = (torch.randn(1, 4, T, 16, device=device) for _ in range(3))
        keys_seen.clear()
        got = compiled(q, k, v)
        assert keys_seen == [min(T, a + 8) - max(0, a - 3) for a in range(0, T, 8)]  # keys a - 3 .. a + 7
        torch.testing.assert_close(
            got, 2 * whole_mask_attention(q, k, v, 4, 0.25, None), rtol=1e-5, atol=1e-5
        )


@pytest.fixture
def kernel() -> None:
    """Ember's CPU kernel of a prompt's attention, where this machine builds it (AVX-512)."""
    q = torch.zeros(1, 1, 1, 16)
    if not attention.cpu_kernel_runs(q, q, q):
        pytest.skip("Ember's prompt attention kernel needs an AVX-512 build of the CPU kernels")


def float64_attention(q, k, v, window, scale):
    """The float64 reference: every query over every key its position shows, from the whole mask."""
    q, k, v = q.double(), k.double(), v.double()
    return whole_mask_attention(q, k, v, window, scale, None)


@pytest.mark.parametrize(
    "B,H,K,T,S,D,window",
    [
        (1, 9, 3, 130, 130, 64, None),  # SmolLM2's heads; positions past a task's 16, keys past a block's 64
        (1, 4, 1, 300, 300, 256, 128),  # Gemma 3 270M's, a local layer's window
        (2, 6, 2, 37, 200, 48, None),  # after a prefix; a head dim of three vectors
        (1, 8, 8, 5, 70, 32, 20),  # no grouping; the window starts inside the prefix
        (1, 4, 2, 1, 65, 16, None),  # one query
    ],
)
def test_the_cpu_kernel_is_the_float64_attention(kernel, B, H, K, T, S, D, window):
    """`ember_cpu::prompt_attention` to float32's precision, with q, k and v strided views of one projection's
    output (as a layer hands them over), and keys no query sees never read: NaN there changes nothing."""
    torch.manual_seed(T + S + D)
    qkv = torch.randn(B, S, (H + 2 * K) * D)[:, S - T :]  # (B, T, ...) rows of a wider tensor
    q = qkv[..., : H * D].unflatten(-1, (H, D)).transpose(1, 2)
    k = torch.randn(B, S, K, D).transpose(1, 2)
    v = torch.randn(B, S, K, 2 * D)[..., :D].transpose(1, 2)
    first_seen = 0 if window is None else max(0, S - T - window + 1)
    k[:, :, :first_seen], v[:, :, :first_seen] = float("nan"), float("nan")
    assert attention.cpu_kernel_runs(q, k, v)
    got = prompt_attention(q, k, v, window=window, scale=D**-0.5)
    assert got.shape == (B, H, T, D)
    want = float64_attention(q.nan_to_num(), k.nan_to_num(), v.nan_to_num(), window, D**-0.5)
    assert (got.double() - want).abs().max() <= 2e-6


def test_a_compiled_prompt_takes_the_cpu_kernel_as_one_op(kernel):
    """Compiled with dynamic shapes (`--compile-prefill`): the kernel is an op of the graph, two prompt lengths
    from one graph, each the float64 attention's values."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: prompt_attention(q, k, v, window=None, scale=0.25) * 2, dynamic=True, fullgraph=True
    )
    compiled(*(torch.randn(1, 4, 39, 16) for _ in range(3)))  # traced and compiled here, not below
    for T in (40, 43):
        q, k, v = (torch.randn(1, 4, T, 16) for _ in range(3))
        with torch.profiler.profile() as prof:
            got = compiled(q, k, v)
        assert [e.name for e in prof.events()].count("ember_cpu::prompt_attention") == 1
        assert (got.double() - 2 * float64_attention(q, k, v, None, 0.25)).abs().max() <= 4e-6
