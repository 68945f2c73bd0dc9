"""Stand-in for torchvision, installed only where no torchvision build matches the local torch.

Composer (and transformers' image utilities) import torchvision at module level but the
tests never use it. Every ``torchvision`` / ``torchvision.x.y`` import succeeds; every
attribute is an inert placeholder class, so ``from torchvision.transforms import
InterpolationMode`` and ``InterpolationMode.BILINEAR`` both resolve.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+eventbus-standin"
__path__: list = []


class _PlaceholderType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class Placeholder(metaclass=_PlaceholderType):
    """Accepts any construction and call; any attribute is itself."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
