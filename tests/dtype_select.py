"""pytest plugin: run the bf16 cases of a selection first, or only the others (bench/gpu_check.sh uses it to get the
bf16 GPU results in before anything else on a short lease).

    PYTHONPATH=tests python3 -m pytest -p dtype_select --dtype-group bf16  -m gpu tests/...   # bf16 cases only
    PYTHONPATH=tests python3 -m pytest -p dtype_select --dtype-group other -m gpu tests/...   # everything else

A case is bf16 when one of its parameters is ``torch.bfloat16`` or a string naming it ("bf16", "bfloat16",
"bf16_sr", ...), or its test id says so; cases without a dtype parameter count as "other". The two groups together
are exactly the selection without the option.
"""

from __future__ import annotations

_NAMES = ("bf16", "bfloat16")


def is_bf16(item) -> bool:
    import torch

    spec = getattr(item, "callspec", None)
    for value in spec.params.values() if spec is not None else ():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if v is torch.bfloat16 or (isinstance(v, str) and any(n in v.lower() for n in _NAMES)):
                return True
    return any(n in item.name.lower() for n in _NAMES)


def pytest_addoption(parser):
    parser.addoption(
        "--dtype-group",
        choices=("bf16", "other"),
        default=None,
        help="keep only the bf16 cases, or only the others (tests/dtype_select.py)",
    )


def pytest_collection_modifyitems(config, items):
    group = config.getoption("--dtype-group")
    if group is None:
        return
    keep, drop = [], []
    for item in items:
        (keep if is_bf16(item) == (group == "bf16") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
