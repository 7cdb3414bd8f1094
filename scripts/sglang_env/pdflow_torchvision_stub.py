"""Import-only stand-in for torchvision inside .venv-sglang (loaded by a .pth file).

SGLang's model configs import `torchvision.transforms` at module level (internvl, deepseek-ocr),
and `sglang.srt.disaggregation.utils` imports every config. The only torchvision wheels this
machine can reach are CUDA builds, which fail to import beside CPU torch. The disaggregation
code never calls torchvision, so a module whose every attribute is an inert placeholder lets
those imports succeed. The finder sits last on sys.meta_path, so a real torchvision, if ever
installed, wins. Nothing here runs outside .venv-sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUBBED_ROOT = "torchvision"


class _PlaceholderType(type):
    # Class-level lookups too (``InterpolationMode.NEAREST_EXACT`` once a module imported the
    # stub, when transformers' probes then find it in sys.modules).
    def __getattr__(cls, name: str) -> type[_Placeholder]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Placeholder(metaclass=_PlaceholderType):
    """Any name a stubbed module is asked for: callable, subclassable, subscriptable, inert."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __class_getitem__(cls, item: Any) -> type[_Placeholder]:
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type[_Placeholder]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so `import torchvision.transforms.v2` works
        # transformers parses torchvision.__version__ once the module is in sys.modules.
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _probing() -> bool:
    """True inside ``importlib.util.find_spec``: availability probes (transformers'
    ``is_torchvision_available``) must see no torchvision, or they take vision code paths."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        code = frame.f_code
        in_util = code.co_filename.endswith(("importlib/util.py", "<frozen importlib.util>"))
        if code.co_name == "find_spec" and in_util:
            return True
        frame = frame.f_back
    return False


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".", 1)[0] != STUBBED_ROOT or _probing():
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
    sys.meta_path.append(_StubFinder())
