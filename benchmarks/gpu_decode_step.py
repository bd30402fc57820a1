"""A decode step's work around the weight GEMVs, on one GPU: Ember's SwiGLU GEMV and its Triton decode
attention (rope + cache write + attention), checked against their plain-torch twins and timed against what
they replace; and the greedy argmax.

    python benchmarks/gpu_decode_step.py --check   # kernels, and a whole model against float32, on the GPU
    python benchmarks/gpu_decode_step.py           # timings (CUDA graphs, Llama-3-8B shapes)

Timings cycle through enough weight / cache copies to defeat the 50 MB L2, as `gpu_gemv.py` does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_gemv import timed_graph  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_kernels() -> None:
    from ember.ops import triton_attention
    from ember.ops.decode_attention import decode_attention_reference
    from ember.ops.rope import Rope, RopeConfig
    from ember.quant import triton_kernels as tk
    from ember.quant.kernels import silu_gate_up_reference
    from ember.quant.linear import quantize_int8_per_channel

    dev, bf = "cuda", torch.bfloat16
    worst = worst_cuda = 0.0
    for H, K, D, R in [(32, 8, 128, 128), (9, 3, 64, 64), (8, 4, 256, 256), (16, 16, 96, 32)]:
        rope = Rope(RopeConfig(theta=10000.0, rotary_dim=R, max_position_embeddings=8192))
        rope.init_buffers(dev)
        for S in (384, 4096):
            qkv = torch.randn(2, (H + 2 * K) * D, device=dev, dtype=bf)
            q, k, v = (t.view(2, -1, D) for t in qkv.split([H * D, K * D, K * D], dim=-1))
            kc = torch.randn(2, K, S, D, device=dev, dtype=bf)
            vc = torch.randn(2, K, S, D, device=dev, dtype=bf)
            pos = torch.tensor([S // 3, S - 1], device=dev)
            cos, sin = (t[:, 0] for t in rope(pos[:, None]))
            for window in (0, 100):
                wk, wv = kc.clone(), vc.clone()
                want = decode_attention_reference(q, k, v, cos, sin, wk, wv, pos, D**-0.5, window)
                for splits, early in ((None, True), (1, True), (4, True), (4, False), (16, True)):
                    gk, gv = kc.clone(), vc.clone()
                    got = triton_attention.decode_attention(
                        q, k, v, cos, sin, gk, gv, pos, D**-0.5, window, splits=splits, early=early
                    )
                    err = max(rel(got, want), rel(gk, wk), rel(gv, wv))
                    worst = max(worst, err)
                    assert err < 2e-2, (H, K, D, R, S, window, splits, early, err)
                from ember.ops import cuda_attention

                if cuda_attention.fits(q, k, v, cos, sin, kc, vc, pos):
                    for config in CUDA_VARIANTS:
                        gk, gv = kc.clone(), vc.clone()
                        got = cuda_attention.decode_attention(
                            q, k, v, cos, sin, gk, gv, pos, D**-0.5, window, config=config[:3]
                        )
                        err = max(rel(got, want), rel(gk, wk), rel(gv, wv))
                        worst_cuda = max(worst_cuda, err)
                        assert err < 2e-2, (H, K, D, R, S, window, config, err)
    print(f"decode attention (rope + cache write) vs reference: worst relative error {worst:.2e}"
          f" (Triton), {worst_cuda:.2e} (CUDA C++)")  # fmt: skip
    worst = 0.0
    for N, K in [(28672, 4096), (16384, 2048), (3072, 576)]:
        x = torch.randn(1, K, device=dev, dtype=bf)
        w = torch.randn(N, K, device=dev, dtype=bf) * 0.02
        q8, s8 = quantize_int8_per_channel(w)
        for weight, scales in [(w, None), (q8, s8.to(bf))]:
            got = tk.fused_gemv(x, weight, scales, glu=True)
            want = silu_gate_up_reference(x.float(), weight if scales is not None else weight.float(),
                                          None if scales is None else scales.float())  # fmt: skip
            err = rel(got, want)
            worst = max(worst, err)
            assert err < 2e-2, (N, K, scales is not None, err)
    print(f"silu(gate) * up GEMV (bf16 / int8) vs float32 reference: worst relative error {worst:.2e}")
    worst = 0.0
    for N, K in [(6144, 4096), (4096, 14336), (1000, 576)]:
        x = torch.randn(1, K, device=dev, dtype=bf)
        q8, s8 = quantize_int8_per_channel(torch.randn(N, K, device=dev) * 0.02)
        want = x.float() @ (q8.float() * s8.float()[:, None]).T
        for magic in (0, 1, 2):
            got = tk.int8_gemv(x, q8, s8.to(bf), blocks=dict(BLOCK_N=8, BLOCK_K=512, MAGIC=magic))
            worst = max(worst, rel(got, want))
        assert worst < 1e-2, (N, K, worst)
    print(f"int8 GEMV, each code-to-float conversion, vs float32: worst relative error {worst:.2e}")
    check_norm_and_argmax()


def check_norm_and_argmax() -> None:
    from ember.ops import triton_norm
    from ember.ops.norm import add_rms_norm_reference
    from ember.ops.triton_argmax import split_argmax

    dev = "cuda"
    for dtype in (torch.bfloat16, torch.float16):
        for E, offset in [(4096, 0.0), (2304, 1.0), (576, 0.0)]:
            x, d = (torch.randn(1, E, device=dev) * 3).to(dtype), torch.randn(1, E, device=dev).to(dtype)
            w = (torch.randn(E, device=dev) * 0.3 + 1).to(dtype)
            h, out = triton_norm.add_rms_norm(x, d, w, 1e-5, offset)
            want_h, want = add_rms_norm_reference(x, d, w, 1e-5, offset)
            assert torch.equal(h, want_h), (dtype, E)
            step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
            bad = ((out.float() - want.float()).abs() > step * want.float().abs() + 1e-6).sum().item()
            assert bad == 0, (dtype, E, offset, bad)
    print("add + RMSNorm kernel: h bit-equal to torch's, the norm within one rounding step")
    for V in (128256, 151936, 262144):
        x = torch.randn(3, V, device=dev)
        x[1, 7] = x[1, V - 2] = 1e3
        x[2, V // 2] = float("nan")
        assert split_argmax(x).tolist() == x.argmax(-1).tolist(), V
        assert split_argmax(x.bfloat16()).tolist() == x.bfloat16().argmax(-1).tolist(), V
    print("split argmax equals torch.argmax (ties, NaN, bf16)")


@torch.inference_mode()
def check_model(shape: str = "llama-3.2-1b", prompt: int = 40, steps: int = 24) -> None:
    """Decode logits of the bf16 model on the GPU (fused kernels) and on the CPU (the unfused torch ops), each
    against the same weights in float32 on the GPU, teacher-forced on the float32 model's greedy tokens."""
    from ember.bench import random_model
    from ember.engine.kv_cache import StaticKVCache

    gpu = random_model(shape, device="cuda", dtype=torch.bfloat16)
    ref = random_model(shape, device="cuda", dtype=torch.float32)
    ref.load_state_dict({k: v.float() for k, v in gpu.state_dict().items()})
    cpu = random_model(shape, device="cpu", dtype=torch.bfloat16)
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    runs = {}
    for name, model, dev in [("ref", ref, "cuda"), ("gpu", gpu, "cuda"), ("cpu", cpu, "cpu")]:
        cache = StaticKVCache(model.config, batch_size=1, max_seq_len=prompt + steps, device=dev,
                              dtype=next(model.parameters()).dtype)  # fmt: skip
        runs[name] = (model, cache, dev)
    tokens = torch.randint(0, gpu.config.vocab_size, (1, prompt))
    logits = {}
    for name, (model, cache, dev) in runs.items():
        pos = torch.arange(prompt)[None].to(dev)
        logits[name] = [model.compute_logits(model(tokens.to(dev), pos, cache)[:, -1]).float().cpu()]
    agree, fed = 0, []
    for i in range(steps):
        nxt = logits["ref"][-1].argmax(-1)
        fed.append(nxt)
        agree += int(logits["gpu"][-1].argmax(-1) == nxt) if i else 0
        for name, (model, cache, dev) in runs.items():
            pos = torch.tensor([[prompt + i]], device=dev)
            out = model(nxt.view(1, 1).to(dev), pos, cache)
            logits[name].append(model.compute_logits(out[:, -1]).float().cpu())
    check_graph_replay(gpu, tokens, fed, logits["gpu"], prompt, steps)
    e_gpu = max(rel(a, b) for a, b in zip(logits["gpu"][1:], logits["ref"][1:], strict=True))
    e_cpu = max(rel(a, b) for a, b in zip(logits["cpu"][1:], logits["ref"][1:], strict=True))
    print(f"{shape}: decode logits vs float32, worst step: GPU fused bf16 {e_gpu:.2e}, CPU unfused bf16 "
          f"{e_cpu:.2e}; GPU greedy agrees with float32 on {agree}/{steps - 1} steps")  # fmt: skip
    assert e_gpu < 2 * e_cpu + 1e-3, "the fused GPU path is further from float32 than the CPU's bf16 ops"


def check_graph_replay(model, tokens, fed: list, eager: list, prompt: int, steps: int) -> None:
    """The decode step compiled into a CUDA graph (its kernels launched with programmatic dependent launch
    where `ember.ops.launch` allows) against the same steps run eagerly, teacher-forced on the same tokens:
    a kernel reading before the one it depends on finished would show here."""
    from ember.engine.kv_cache import StaticKVCache
    from ember.ops.launch import pdl

    cache = StaticKVCache(model.config, batch_size=1, max_seq_len=prompt + steps, device="cuda",
                          dtype=torch.bfloat16)  # fmt: skip
    for t in cache.k + cache.v:
        torch._dynamo.mark_static_address(t)
    model(tokens.cuda(), torch.arange(prompt, device="cuda")[None], cache)

    def forward(tok, pos, cache):
        return model.compute_logits(model(tok, pos, cache)[:, -1])

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    worst = 0.0
    pos = torch.tensor([[prompt]], device="cuda")
    for i in range(steps):
        tok = fed[i].view(1, 1).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        got = step(tok, pos, cache).float().cpu()
        pos += 1
        worst = max(worst, rel(got, eager[i + 1]))
    print(f"compiled decode step (CUDA graph, PDL {pdl(torch.device('cuda'))}) vs eager: worst relative "
          f"logit difference {worst:.2e} over {steps} steps")  # fmt: skip
    assert worst < 2e-2, worst
    torch._dynamo.reset()


# Decode attention variants timed: (chunks, slots per step, warps, early reads).
VARIANTS = [
    (2, 128, 4, False),  # the fourth session's tiles, no reads before the wait
    (2, 128, 8, False),
    (2, 128, 8, True),  # the default up to 512 slots
    (2, 64, 8, True),
    (1, 128, 8, True),
    (4, 64, 8, True),
    (8, 64, 8, True),
    (16, 64, 4, True),  # the default at 2048 slots and past
    (16, 64, 8, True),
    (16, 64, 4, False),
]


def attention_layers(S: int, layers: int):
    """`layers` Llama-3-8B attention layers at S cache slots, bf16, on the GPU: (caches, qkv_of(i): layer i's
    q, k, v from its qkv GEMV, cos, sin, seconds of that GEMV alone in a CUDA graph)."""
    from ember.quant import triton_kernels as tk

    H, K, D = 32, 8, 128
    bf = torch.bfloat16
    caches = [(torch.randn(1, K, S, D, device="cuda", dtype=bf), torch.randn(1, K, S, D, device="cuda", dtype=bf))
              for _ in range(layers)]  # fmt: skip
    hidden = torch.randn(1, 4096, device="cuda", dtype=bf)
    w_qkv = [torch.randn((H + 2 * K) * D, 4096, device="cuda", dtype=bf) * 0.02 for _ in range(layers)]
    cos, sin = torch.rand(1, D, device="cuda"), torch.rand(1, D, device="cuda")

    def qkv_of(i):
        qkv = tk.float_gemv(hidden, w_qkv[i % layers])
        return (u.view(1, -1, D) for u in qkv.split([H * D, K * D, K * D], dim=-1))

    gemv = timed_graph(lambda i: tk.float_gemv(hidden, w_qkv[i % layers]), layers)
    return caches, qkv_of, cos, sin, gemv


def time_attention_at(S: int, layers: int = 32) -> None:
    """us per layer of each variant, in a CUDA graph where each attention follows its layer's qkv GEMV (as
    in the step; the GEMV alone is timed and subtracted), and SDPA (attention only) alone."""
    from ember.ops import triton_attention
    from ember.ops.attention import causal_mask, sdpa_attention

    caches, qkv_of, cos, sin, gemv = attention_layers(S, layers)
    D = 128
    for p in (S // 4, S - 1):
        pos = torch.tensor([p], device="cuda")
        mask = causal_mask(pos[:, None], torch.arange(S, device="cuda")[None], None)
        q = torch.randn(1, 32, D, device="cuda", dtype=torch.bfloat16)
        row = [
            timed_graph(
                lambda i, m=mask, q=q: sdpa_attention(q[:, :, None], *caches[i % layers], m, scale=D**-0.5),
                layers,
            )
        ]
        for sp, bs, w, early in VARIANTS:

            def call(i, sp=sp, bs=bs, w=w, early=early, ps=pos):
                qn, kn, vn = qkv_of(i)
                return triton_attention.decode_attention(
                    qn,
                    kn,
                    vn,
                    cos,
                    sin,
                    *caches[i % layers],
                    ps,
                    D**-0.5,
                    0,
                    *caches[(i + 1) % layers],  # the next layer's, prefetched into L2 on sm_90+
                    splits=sp,
                    block_s=bs,
                    num_warps=w,
                    early=early,
                )

            row.append(timed_graph(call, layers) - gemv)
        print(f"{S:>6} {p:>6} " + " ".join(f"{t * 1e6:8.2f}" for t in row) +
              f"   (default {triton_attention.default_tiles(S, 128, prefetch=True)}; qkv GEMV alone {gemv * 1e6:.2f})", flush=True)  # fmt: skip


# The CUDA C++ decode attention's variants timed: (warps, steps in flight, cluster blocks, L2 prefetch).
CUDA_VARIANTS = [
    (4, 8, 8, False),
    (4, 8, 8, True),
    (4, 4, 8, True),
    (8, 4, 8, True),
    (2, 8, 8, True),
    (4, 8, 4, True),
    (8, 8, 4, True),
    (4, 8, 2, True),
    (8, 8, 1, True),
]


def time_cuda_attention_at(S: int, layers: int = 32) -> None:
    """us per Llama-3-8B layer at S slots: the Triton kernel at its default tiles against the CUDA C++ kernel's
    variants, each after its layer's qkv GEMV in a CUDA graph (the GEMV alone subtracted)."""
    from ember.ops import cuda_attention, triton_attention

    caches, qkv_of, cos, sin, gemv = attention_layers(S, layers)
    D = 128

    def triton_call(i, pos):
        qn, kn, vn = qkv_of(i)
        return triton_attention.decode_attention(
            qn, kn, vn, cos, sin, *caches[i % layers], pos, D**-0.5, 0, *caches[(i + 1) % layers]
        )

    def cuda_call(i, pos, config, prefetch):
        qn, kn, vn = qkv_of(i)
        return cuda_attention.decode_attention(
            qn, kn, vn, cos, sin, *caches[i % layers], pos, D**-0.5, 0, *caches[(i + 1) % layers],
            config=config, prefetch=prefetch,
        )  # fmt: skip

    for p in (S // 4, S // 2, S - 1):
        pos = torch.tensor([p], device="cuda")
        row = [timed_graph(lambda i, ps=pos: triton_call(i, ps), layers) - gemv]
        for w, st, c, f in CUDA_VARIANTS:
            row.append(
                timed_graph(lambda i, ps=pos, cf=(w, st, c), f=f: cuda_call(i, ps, cf, f), layers) - gemv
            )
        print(f"{S:>6} {p:>6} " + " ".join(f"{t * 1e6:10.2f}" for t in row), flush=True)


def time_cuda_attention() -> None:
    heads = ["triton"] + [f"w{w}p{p}c{c}{'f' if f else ''}" for w, p, c, f in CUDA_VARIANTS]
    print("decode attention after its qkv GEMV, Llama-3-8B layer, us per layer (GEMV time subtracted);"
          " CUDA C++: w warps, p steps in flight, c blocks a cluster, f L2 prefetch of the next layer")  # fmt: skip
    print(f"{'S':>6} {'pos':>6} " + " ".join(f"{h:>10}" for h in heads))
    for S in (384, 512, 1024):
        time_cuda_attention_at(S)


def time_attention() -> None:
    print("decode attention after its qkv GEMV, Llama-3-8B layer, us per layer (SDPA: attention only, alone;"
          " Ember: rope + cache write + attention, GEMV time subtracted); s chunks, b slots/step, w warps,"
          " e early reads")  # fmt: skip
    heads = [f"s{sp}b{bs}w{w}{'e' if e else ''}" for sp, bs, w, e in VARIANTS]
    print(f"{'S':>6} {'pos':>6} {'SDPA':>8} " + " ".join(f"{h:>8}" for h in heads))
    for S in (384, 512, 2048, 8192):
        time_attention_at(S)


def time_glu_gemv(N: int, K: int) -> None:
    from ember.quant import triton_kernels as tk

    copies = max(2, (768 << 20) // (N * K * 2))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)

    def unfused(i):
        gate, up = tk.fused_gemv(x, ws[i % copies]).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    plain = timed_graph(lambda i: tk.fused_gemv(x, ws[i % copies]), copies * 4)
    eager = timed_graph(unfused, copies * 4)
    fused = timed_graph(lambda i: tk.fused_gemv(x, ws[i % copies], glu=True), copies * 4)
    print(
        f"gate_up {N}x{K}: GEMV {plain * 1e6:.2f} us, GEMV + silu*mul (eager) {eager * 1e6:.2f}, fused {fused * 1e6:.2f}"
    )


def time_argmax(V: int = 128256) -> None:
    from ember.ops.triton_argmax import split_argmax

    logits = [torch.randn(1, V, device="cuda") for _ in range(8)]
    t = timed_graph(lambda i: logits[i % 8].argmax(dim=-1), 32)
    split = {
        b: timed_graph(lambda i, b=b: split_argmax(logits[i % 8], block=b), 32)
        for b in (1024, 2048, 4096, 8192)
    }
    print(f"argmax over {V} float32 logits: torch {t * 1e6:.2f} us; split (block: us) "
          + ", ".join(f"{b}: {s * 1e6:.2f}" for b, s in split.items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="check the kernels and a model; no timings")
    ap.add_argument("--argmax", action="store_true", help="time only the greedy argmax")
    ap.add_argument(
        "--cuda-attention", action="store_true", help="time only decode attention, Triton vs CUDA C++"
    )
    args = ap.parse_args()
    if args.argmax:
        return time_argmax()
    if args.cuda_attention:
        return time_cuda_attention()
    if args.check:
        check_kernels()
        check_model()
        return
    time_attention()
    time_glu_gemv(28672, 4096)
    time_argmax()


if __name__ == "__main__":
    main()
