"""The schedule IR: which device runs which action, in which order.

A pipeline step is a set of actions ``Action(op, stage, microbatch)``:
``F`` runs a stage's forward on one micro-batch, ``B`` its backward and ``W``
the weight-gradient half of the backward when a schedule splits it off
(zero bubble, Qi et al. 2024, sec. 2). A :class:`Schedule` lists, per device,
the order the device runs its actions. Every executor, the simulator, the
plots and the grader read this one type.

The package, one idea a module (each imports only those listed before it):
  * ``ir``          :class:`Action`, :class:`Schedule` and the text form ``1F0`` (as torch's pipelining)
  * ``generators``  :func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`, :func:`zero_bubble_h1`,
                    :func:`pipedream_async`, :func:`interleaved_zero_bubble`, :func:`looped_bfs`
  * ``v_schedules`` two stages a device in a V (:func:`v_placement`): :func:`zero_bubble_v`, :func:`dualpipe_v`
  * ``registry``    :class:`ScheduleSpec`, :func:`register`, :func:`make_schedule`, the bubble and peak formulas
  * ``engine``      :func:`dependencies`, :func:`encode`, :func:`walk`, :func:`validate`, :func:`execution_order`
  * ``versions``    :class:`WeightPolicy`, the named :data:`POLICIES` and :func:`weight_versions`
"""

from .engine import (
    DeadlockError,
    DeadlockReport,
    EncodedSchedule,
    Walk,
    dependencies,
    encode,
    execution_order,
    validate,
    walk,
)
from .generators import (
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    pipedream_async,
    zero_bubble_h1,
)
from .ir import OPS, Action, Schedule, ScheduleError
from .registry import (
    SCHEDULES,
    ScheduleSpec,
    default_schedule,
    make_schedule,
    register,
    resolve_stages_per_device,
    schedule_names,
    schedule_spec,
    unregister,
)
from .v_schedules import dualpipe_v, v_placement, zero_bubble_v
from .versions import (
    BASELINES,
    PER_MICROBATCH_BASELINE,
    PER_MINIBATCH_BASELINE,
    POLICIES,
    VARIANT_LABELS,
    Baseline,
    NamedPolicy,
    WeightPolicy,
    variant_label,
    weight_versions,
)

__all__ = [
    "OPS", "Action", "Schedule", "ScheduleError",
    "gpipe", "one_f_one_b", "zero_bubble_h1", "pipedream_async", "interleaved_1f1b", "interleaved_zero_bubble",
    "looped_bfs",
    "zero_bubble_v", "dualpipe_v",
    "v_placement",
    "ScheduleSpec", "SCHEDULES", "register", "unregister", "schedule_names", "schedule_spec", "make_schedule",
    "default_schedule", "resolve_stages_per_device",
    "dependencies", "EncodedSchedule", "encode", "validate", "DeadlockReport", "DeadlockError", "Walk", "walk",
    "execution_order",
    "WeightPolicy", "NamedPolicy", "POLICIES", "Baseline", "BASELINES", "PER_MINIBATCH_BASELINE",
    "PER_MICROBATCH_BASELINE", "VARIANT_LABELS", "variant_label", "weight_versions",
]
