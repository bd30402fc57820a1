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
