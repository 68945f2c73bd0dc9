"""Read-only stand-ins for the live objects a Composer callback reads off ``State``.

Out of process there is no model, optimizer or metric object, only what the
trainer captured. These views give that data the names and shapes of the live
objects (``optimizers[0].param_groups[0]["lr"]``, ``model.named_parameters()``,
``eval_metrics[label][name].compute()``) without importing torch: this module
runs where torch may be missing.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Iterator, Mapping, NoReturn, Optional, Sequence

from eventbus.errors import WeightsNotCaptured

__all__ = ["Scalar", "GradView", "ParameterView", "ModelView", "OptimizerView", "SchedulerView",
           "MetricView", "EvaluatorView", "DeviceView", "ReadOnlyDict", "named_view"]


def _read_only(obj: object, name: str) -> NoReturn:
    raise AttributeError(f"{type(obj).__name__}.{name} is read-only: a subscriber sees a snapshot of the "
                         "training state, not the live object")


def _to_torch(value: Any) -> Any:
    """A Scalar as a 0-dim tensor. Only called from ``__torch_function__``, so torch is already imported."""
    torch = sys.modules["torch"]
    return torch.tensor(float(value)) if isinstance(value, Scalar) else value


class Scalar(float):
    """A captured 0-dim tensor value (loss, a metric, a norm): a float with the tensor methods callbacks use.

    A float subclass rather than a torch tensor: the subscriber side may have no torch, and a
    float keeps arithmetic, comparisons, formatting and ``isinstance(x, float)`` working. Passed
    to a torch function, it becomes a real 0-dim tensor (``__torch_function__``)."""

    __slots__ = ()
    shape: tuple[int, ...] = ()
    ndim = 0
    requires_grad = False
    is_cuda = False

    def item(self) -> float:
        return float(self)

    def tolist(self) -> float:
        return float(self)

    def detach(self) -> "Scalar":
        return self

    cpu = clone = detach

    def numel(self) -> int:
        return 1

    def dim(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return ()

    def isnan(self) -> bool:
        return math.isnan(self)

    def numpy(self) -> Any:
        import numpy  # only a caller that wants numpy values needs numpy

        return numpy.asarray(float(self), dtype=numpy.float32)

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        return func(*[_to_torch(a) for a in args], **{k: _to_torch(v) for k, v in (kwargs or {}).items()})


class GradView:
    """A parameter's gradient as captured: its L2 norm only (``norm()``, ``torch.linalg.vector_norm``)."""

    __slots__ = ("_norm", "shape", "dtype")
    _norm: Scalar
    shape: tuple[int, ...]
    dtype: str
    _NORMS = frozenset({"norm", "vector_norm", "linalg_vector_norm", "linalg_norm"})  # torch names them so

    def __init__(self, norm: float, shape: tuple[int, ...], dtype: str):
        object.__setattr__(self, "_norm", Scalar(norm))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)

    def norm(self, p: Any = 2, *args: Any, **kwargs: Any) -> Scalar:
        if p not in (2, 2.0, "fro", None):
            raise TypeError(f"only the L2 norm of this gradient was captured (asked for p={p!r})")
        return self._norm

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        # OptimizerMonitor calls torch.linalg.vector_norm(p.grad): answer from the captured norm.
        if getattr(func, "__name__", "") in cls._NORMS and args and isinstance(args[0], GradView):
            kwargs = dict(kwargs or {})
            order = args[1] if len(args) > 1 else kwargs.pop("ord", kwargs.pop("p", 2))
            return args[0].norm(order)
        raise TypeError(f"{getattr(func, '__name__', func)}: out of process, a gradient is only its captured "
                        "L2 norm (use .norm() or torch.linalg.vector_norm)")

    def __repr__(self) -> str:
        return f"GradView(norm={float(self._norm)!r}, shape={self.shape})"


class ParameterView:
    """One model parameter: name, shape, dtype (a string such as ``"torch.float32"``), ``grad`` if captured,
    and the trainer's ``device`` (callbacks such as Composer's MemoryMonitor find the model's device
    as ``next(model.parameters()).device``)."""

    __slots__ = ("name", "shape", "dtype", "requires_grad", "grad", "device")
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    grad: Optional[GradView]
    device: "DeviceView"

    def __init__(self, name: str, shape: Sequence[int], dtype: str, requires_grad: bool,
                 grad_norm: Optional[float] = None, device: str = "cpu"):
        setattr_ = object.__setattr__
        setattr_(self, "name", name)
        setattr_(self, "shape", tuple(shape))
        setattr_(self, "dtype", dtype)
        setattr_(self, "requires_grad", bool(requires_grad))
        setattr_(self, "grad", GradView(grad_norm, self.shape, dtype) if grad_norm is not None else None)
        setattr_(self, "device", DeviceView(device))

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self) -> tuple[int, ...]:
        return self.shape

    ndim = property(dim)

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    def __repr__(self) -> str:
        return f"ParameterView({self.name!r}, shape={self.shape}, dtype={self.dtype})"


_CLASSES: dict[tuple[type, str], type] = {}


def named_view(base: type, name: Optional[str]) -> type:
    """A subclass of ``base`` called ``name``, so ``type(view).__name__`` reads like the live object's."""
    if not name or not name.isidentifier():
        return base
    key = (base, name)
    if key not in _CLASSES:
        _CLASSES[key] = type(name, (base,), {"__slots__": (), "__module__": base.__module__})
    return _CLASSES[key]


class ModelView:
    """The model's parameters as the run header describes them, with this batch's gradient norms,
    and ``state_dict()``: the weights as they were at this event, where the trainer staged them."""

    __slots__ = ("_params", "_grad_norms", "_device", "_weights")
    _params: Sequence[Sequence[Any]]
    _grad_norms: Mapping[str, float]
    _device: str
    _weights: Optional[Callable[[], dict[str, Any]]]

    def __init__(self, params: Sequence[Sequence[Any]], grad_norms: Optional[Mapping[str, float]],
                 device: str = "cpu", weights: Optional[Callable[[], dict[str, Any]]] = None):
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_grad_norms", grad_norms or {})
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_weights", weights)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's weights as they were at this event (CPU tensors, this process's own copy);
        :class:`~eventbus.errors.WeightsNotCaptured` where the trainer staged none, saying why."""
        if self._weights is None:
            raise WeightsNotCaptured("state.model.state_dict(): this snapshot has no weights (only a worker's "
                                     "snapshots of a live run can have them)")
        return dict(self._weights())

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, ParameterView]]:
        norms = self._grad_norms
        for name, shape, dtype, requires_grad in self._params:
            yield name, ParameterView(name, shape, dtype, requires_grad, norms.get(name), self._device)

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[ParameterView]:
        return (p for _, p in self.named_parameters())

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape, _, _ in self._params)

    @property
    def module(self) -> "ModelView":
        """What DDP-unwrapping code reads (``model.module``, as Composer's SpeedMonitor does when the
        model is not a ``ComposerModel``): the view already describes the unwrapped model."""
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(view: {len(self._params)} parameters, {self.num_params} values)"


class ReadOnlyDict(dict):  # type: ignore[type-arg]
    """A dict that refuses writes (a param group as captured)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a param group seen from a subscriber is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]


class OptimizerView:
    """An optimizer's param groups as captured at its last LR event: hyperparameters, no params."""

    __slots__ = ("param_groups",)
    param_groups: list[ReadOnlyDict]

    def __init__(self, groups: Sequence[Mapping[str, Any]]):
        object.__setattr__(self, "param_groups", [
            ReadOnlyDict({k: tuple(v) if isinstance(v, list) else v for k, v in group.items()})
            for group in groups])

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(view: {len(self.param_groups)} param groups)"


class SchedulerView:
    """A scheduler as captured: its class name and ``get_last_lr()``."""

    __slots__ = ("_last_lr",)
    _last_lr: Optional[list[float]]

    def __init__(self, last_lr: Optional[Sequence[float]]):
        object.__setattr__(self, "_last_lr", list(last_lr) if last_lr is not None else None)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise AttributeError(f"{type(self).__name__} has no get_last_lr() in the training process")
        return list(self._last_lr)

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)


class MetricView:
    """A metric as last computed by the trainer; ``compute()`` returns its value (nan before any)."""

    __slots__ = ("name", "_value")
    name: str
    _value: Any

    def __init__(self, name: str, value: Any):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_value", Scalar(value) if isinstance(value, (int, float)) else value)

    def compute(self) -> Any:
        return self._value if self._value is not None else Scalar(math.nan)

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(view: {self._value!r})"


class EvaluatorView:
    """An evaluator's label and metric names."""

    __slots__ = ("label", "metric_names")
    label: str
    metric_names: Optional[list[str]]

    def __init__(self, label: str, metric_names: Optional[Sequence[str]]):
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "metric_names", list(metric_names) if metric_names is not None else None)

    def __setattr__(self, name: str, value: Any) -> None:
        _read_only(self, name)

    def __repr__(self) -> str:
        return f"EvaluatorView(label={self.label!r})"


class DeviceView(str):
    """The trainer's device as its string (``"cuda:0"``), with ``torch.device``'s ``type``.

    (Not ``index``: that name is ``str.index``.)"""

    __slots__ = ()

    @property
    def type(self) -> str:
        return self.partition(":")[0]
