"""ember.ops.cuda_rtc on any machine: what NVRTC is handed for Ember's kernel sources."""

import re
from fnmatch import fnmatch
from pathlib import Path

from ember.ops import cuda_rtc

PACKAGE = Path(cuda_rtc.__file__).parents[1]
ROOT = Path(__file__).parents[2]


def test_every_include_of_a_kernel_source_is_handed_to_nvrtc_and_shipped():
    sources = sorted(PACKAGE.glob("*/csrc/*.cu"))
    assert sources, PACKAGE
    included = {name for path in sources for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included and included <= set(cuda_rtc.headers())
    table = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    patterns = re.findall(r'"([^"]+)"', re.search(r"^ember = \[(.*?)\]", table, re.M | re.S).group(1))
    for path in [*sources, *cuda_rtc.HEADERS]:
        relative = path.relative_to(PACKAGE).as_posix()
        assert any(fnmatch(relative, p) for p in patterns), relative


def test_a_failed_build_is_logged_once_and_not_tried_again(monkeypatch, caplog):
    # What the kernels' callers rely on to fall back to Triton: None, one warning naming the kernel, and no
    # second NVRTC run (seconds each) for the same source and device.
    import torch

    calls = []

    def failing_load(path, names, device):
        calls.append(names)
        raise cuda_rtc.CudaError("nvrtcCompileProgram: NVRTC_ERROR_COMPILATION")

    monkeypatch.setattr(cuda_rtc, "load", failing_load)
    monkeypatch.setattr(cuda_rtc, "_UNBUILT", set())
    source, device = PACKAGE / "quant" / "csrc" / "int4_gemv.cu", torch.device("cuda", 0)
    with caplog.at_level("WARNING", logger="ember.ops.cuda_rtc"):
        for _ in range(3):
            assert cuda_rtc.load_or_none(source, ["k<1>"], device, "CUDA int4 GEMV") is None
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "Ember's CUDA int4 GEMV could not be built (nvrtcCompileProgram: NVRTC_ERROR_COMPILATION); "
        "the Triton kernel runs instead"
    ]
    assert cuda_rtc.load_or_none(source, ["k<1>"], torch.device("cuda", 1), "CUDA int4 GEMV") is None
    assert len(calls) == 2  # another device is tried
    assert cuda_rtc.load_or_none(source, ["k<2>"], device, "CUDA int4 GEMV (ASYNC)") is None
    assert len(calls) == 3  # and another set of the source's kernels (a build of its own)
