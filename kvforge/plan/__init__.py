"""Parallelism planning: how a model splits over devices (tensor x pipeline), what each device holds,
and how fast the split can decode and prefill at best. `kvforge plan` is its command."""

from kvforge.plan.devices import DeviceSpec, get_device
from kvforge.plan.estimate import Plan, PlanOptions, SplitEstimate, make_plan
from kvforge.plan.model_shape import ModelShape, build_model_shape, load_model_shape
from kvforge.plan.precision import Precision, resolve_precision

__all__ = [
    "DeviceSpec", "ModelShape", "Plan", "PlanOptions", "Precision", "SplitEstimate", "build_model_shape",
    "get_device", "load_model_shape", "make_plan", "resolve_precision",
]
