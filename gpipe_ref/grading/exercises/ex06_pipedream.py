"""Exercises for notebook 06: 1F1B's warm-up, the 1F1B schedule, PipeDream's weight versions."""

from __future__ import annotations

import random

from ...schedule import POLICIES, Action, WeightPolicy, one_f_one_b, pipedream_async, weight_versions
from ...simulator import simulate
from ..cases import Case, Exercise
from ..judge import same, short_repr
from .common import dict_or_type, judge_one_stage_per_device, schedule_generators

__all__ = ["EXERCISES", "ONE_F_ONE_B", "PREDICT_VERSIONS", "STASHED", "TWO_BW", "VARIANTS", "WARMUP"]

# -- 06.1 forwards before the first backward ---------------------------------------------------------------


def _warmup_case(p: int, m: int, device: int, shown: bool = True) -> Case:
    def compare(actual, expected):
        if isinstance(actual, int) and not isinstance(actual, bool) and actual > m:
            return f"device {device} cannot run {actual} forwards: there are only m = {m} micro-batches"
        if shown or not isinstance(actual, int) or isinstance(actual, bool) or actual == expected:
            return same(actual, expected, f"device {device}")
        return (f"device {device}: {actual} forwards is too {'many' if actual > expected else 'few'}: its first "
                f"backward can run {'earlier' if actual > expected else 'only later'}")

    return Case(f"p={p}, m={m}, device={device}", lambda answer: answer(p, m, device),
                lambda: next(i for i, a in enumerate(one_f_one_b(p, m).per_device[device]) if a.op == "B"),
                compare=compare,
                hint="follow micro-batch 0: which stages must it pass, forward and back, before its gradient "
                     "reaches this device, and what else can the device do meanwhile? What if there are few "
                     "micro-batches?")


def _warmup_drawn(rng: random.Random) -> list[Case]:
    return [_warmup_case(p, rng.randrange(1, 33), rng.randrange(p), shown=False)
            for p in (rng.randrange(1, 9) for _ in range(2))]


WARMUP = Exercise(
    "06.1", "1F1B: forwards before the first backward", "forwards_before_first_backward", 2,
    lambda: [_warmup_case(4, 8, d) for d in range(4)] + [_warmup_case(4, 2, d) for d in range(4)],
    lambda: [_warmup_case(p, m, d, shown=False)
             for p, m in ((1, 1), (2, 1), (4, 2), (6, 3), (8, 32), (5, 5)) for d in range(p)],
    forbidden=schedule_generators, category="formula", drawn=_warmup_drawn)

# -- 06.2 the 1F1B schedule ---------------------------------------------------------------------------------------


def _one_f_one_b_case(p: int, m: int) -> Case:
    def expected():
        return {"held": [min(m, p - d) for d in range(p)], "bubble": round((p - 1) / (m + p - 1), 12)}

    def compare(actual, expected):
        schedule = judge_one_stage_per_device(actual, p, m, "yours", forwards_first=False)
        if isinstance(schedule, str):
            return schedule
        timeline = simulate(schedule)
        held = [timeline.peak_in_flight(d) for d in range(p)]
        for d, (yours, theirs) in enumerate(zip(held, expected["held"])):
            if yours > theirs:
                return (f"device {d}'s peak is {_microbatches(yours)} in flight, too many: it runs more forwards "
                        f"before a backward than it needs to")
            if yours < theirs:
                return (f"device {d}'s peak is {_microbatches(yours)} in flight, too few: it waits for a backward "
                        f"before it has run the forwards that keep the later stages busy")
        bubble = round(timeline.bubble_fraction, 12)
        if bubble != expected["bubble"]:
            return (f"simulated bubble {bubble:.4f}, {'more' if bubble > expected['bubble'] else 'less'} than "
                    f"1F1B's with the same micro-batches in flight")
        return None

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), expected, compare=compare,
                hint="which device can start a backward first, and how long until the others can? What does "
                     "each device do while it waits, and once its first backward has run?")


def _microbatches(n: int) -> str:
    return f"{n} micro-batch" + ("" if n == 1 else "es")


def _one_f_one_b_drawn(rng: random.Random) -> list[Case]:
    return [_one_f_one_b_case(rng.randrange(1, 9), rng.randrange(1, 17))]


ONE_F_ONE_B = Exercise(
    "06.2", "The 1F1B schedule", "one_f_one_b_actions", 3,
    lambda: [_one_f_one_b_case(2, 4), _one_f_one_b_case(4, 8), _one_f_one_b_case(4, 2)],
    lambda: [_one_f_one_b_case(p, m) for p, m in ((1, 1), (1, 4), (3, 1), (4, 2), (5, 7), (8, 16))],
    forbidden=schedule_generators, category="build", drawn=_one_f_one_b_drawn)

# -- 06.3 PipeDream's stashed weight version and its staleness ---------------------------------------------------


def _version_case(p: int, stage: int, microbatch: int, shown: bool = True) -> Case:
    def expected():
        schedule = pipedream_async(p, microbatch + p)
        version = weight_versions(schedule)[Action("F", stage, microbatch)]
        device = schedule.per_device[schedule.stage_to_device[stage]]
        updates_before_backward = sum(1 for a in device[:device.index(Action("B", stage, microbatch))]
                                      if a.op == "B" and a.stage == stage)
        return version, updates_before_backward - version

    def compare(actual, expected):
        if not isinstance(actual, (tuple, list)) or len(actual) != 2:
            return f"expected a pair (version, staleness), got {short_repr(actual)}"
        for what, yours, theirs in zip(("version", "staleness"), actual, expected):
            if isinstance(yours, bool) or not isinstance(yours, int):
                return f"the {what} must be an int, got {short_repr(yours)}"
            if yours != theirs:
                told = f" (the schedule's is {theirs})" if shown else ""
                return f"the {what} {yours} is too {'high' if yours > theirs else 'low'}{told}"
        return None

    return Case(f"p={p}, stage={stage}, microbatch={microbatch}", lambda answer: answer(p, stage, microbatch),
                expected, compare=compare,
                hint="on stage s's device, how many of that stage's backwards (each one an update) run before "
                     "micro-batch k's forward, and how does that change from the first stage to the last? Staleness "
                     "counts the updates between the forward and the update that applies k's gradient")


def _version_drawn(rng: random.Random) -> list[Case]:
    return [_version_case(p, rng.randrange(p), rng.randrange(4 * p + 2), shown=False)
            for p in (rng.randrange(1, 9) for _ in range(2))]


STASHED = Exercise(
    "06.3", "PipeDream: the stashed weight version and its staleness", "stashed_version", 3,
    lambda: [_version_case(5, s, k) for s, k in ((0, 0), (0, 2), (0, 7), (2, 7), (4, 7))],
    lambda: [_version_case(p, s, k, shown=False)
             for p in (1, 2, 3, 6, 8) for s in range(p) for k in (0, 1, p - 1, p, 3 * p + 1)],
    forbidden=("gpipe_ref.schedule.pipedream_async", "gpipe_ref.schedule.weight_versions",
               "gpipe_ref.staleness.version_table", "gpipe_ref.staleness.StagedTrainer"), category="derive",
               drawn=_version_drawn)

# -- 06.4 predict, then check: versions held and staleness, with stashing and with vertical sync ------------------

VARIANTS = {"stashing": WeightPolicy(stashing=True), "vertical_sync": WeightPolicy(vertical_sync=True)}
# PipeDream-2BW: the named policy that updates once per mini-batch (06.5)
PER_BATCH_POLICY = next(row.policy for row in POLICIES.values() if row.policy.updates_every is None)


def _measured(p: int, m: int) -> dict:
    """What a real run of PipeDream's schedule with m micro-batches records, per variant: each stage's peak
    versions held and the largest staleness of any micro-batch on it."""
    from ...staleness import version_table

    out = {}
    for name, policy in VARIANTS.items():
        record = version_table(pipedream_async(p, m), policy=policy)
        out[name] = {"held": list(record.stash_peak),
                     "staleness": [max(record.versions[(s, i)][2] for i in range(m)) for s in range(p)]}
    return out


def _prediction_case(p: int, m: int, shown: bool = True) -> Case:
    def compare(actual, expected):
        if not isinstance(actual, dict) or set(actual) != set(VARIANTS):
            return f"expected a dict with the keys {sorted(VARIANTS)}, got {dict_or_type(actual)}"
        for name in VARIANTS:
            entry = actual[name]
            if not isinstance(entry, dict) or set(entry) != {"held", "staleness"}:
                return f"{name}: expected a dict with the keys ['held', 'staleness'], got {dict_or_type(entry)}"
            for key in ("held", "staleness"):
                values = entry[key]
                if not isinstance(values, list) or len(values) != p:
                    return (f"{name}[{key!r}]: expected a list of p = {p} numbers (one per stage), "
                            f"got {short_repr(values)}")
                for stage, (yours, run) in enumerate(zip(values, expected[name][key])):
                    if yours != run:
                        what = "versions held at once" if key == "held" else "largest staleness"
                        if shown or isinstance(yours, bool) or not isinstance(yours, (int, float)):
                            return (f"{name}, stage {stage}: you predicted {what} {short_repr(yours)}, the run "
                                    f"measured {run}")
                        return (f"{name}, stage {stage}: you predicted {what} {yours}, the run measured "
                                f"{'less' if yours > run else 'more'}")
        return None

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), lambda: _measured(p, m), compare=compare,
                hint="replay the run on one stage, from its first forward to its last backward: which versions "
                     "are stashed while its micro-batches are in flight, and how many updates pass before each "
                     "one's gradient is applied? With few micro-batches, which versions are ever made? Under "
                     "vertical sync, whose choice of version does a later stage follow, and how long must it keep it?")


def _prediction_drawn(rng: random.Random) -> list[Case]:
    return [_prediction_case(rng.choice([1, 2, 4, 8]), rng.randrange(1, 13), shown=False)]  # p divides 8 layers


PREDICT_VERSIONS = Exercise(
    "06.4", "Predict, then check: versions held and staleness", "predict_pipedream", 3,
    lambda: [_prediction_case(4, 3), _prediction_case(2, 5)],
    lambda: [_prediction_case(p, m, shown=False) for p, m in ((1, 1), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4),
                                                               (4, 5), (4, 6), (8, 3), (8, 7), (8, 8), (8, 9),
                                                               (8, 20))],
    forbidden=("gpipe_ref.staleness.version_table", "gpipe_ref.staleness.StagedTrainer",
               "gpipe_ref.schedule.WeightPolicy", "gpipe_ref.schedule.weight_versions",
               "gpipe_ref.schedule.pipedream_async", "gpipe_ref.simulator.simulate"),
    category="predict", drawn=_prediction_drawn)

# -- 06.5 build PipeDream-2BW's version rule ---------------------------------------------------------------------


def _per_batch_expected(p: int, batch: int, n: int):
    """The library's 2BW run: None when the order does not suit 2BW, else each device's versions (one per action,
    in order) and staleness (one per backward, in order)."""
    from ...staleness import version_table

    schedule = pipedream_async(p, n)
    policy = PER_BATCH_POLICY.per_batch(batch)
    try:
        policy.check(schedule)
    except ValueError:
        return None
    record = version_table(schedule, policy=policy)
    return {"versions": [[record.versions[(a.stage, a.microbatch)][0 if a.op == "F" else 1] for a in acts]
                         for acts in schedule.per_device],
            "staleness": [[record.versions[(a.stage, a.microbatch)][2] for a in acts if a.op == "B"]
                          for acts in schedule.per_device]}


def _per_batch_case(p: int, batch: int, batches: int) -> Case:
    n = batch * batches

    def run(answer):
        return answer([list(acts) for acts in pipedream_async(p, n).per_device], batch)

    def compare(actual, expected):
        if expected is None:
            return None if actual is None else (f"2BW cannot run batches of {batch} micro-batches on {p} stages "
                                                f"(Narayanan et al. 2021, sec. 3.1): expected None, got "
                                                f"{dict_or_type(actual)}")
        if actual is None:
            return f"returned None, but 2BW runs batches of {batch} micro-batches on {p} stages"
        if not isinstance(actual, dict) or set(actual) != {"versions", "staleness"}:
            return f"expected a dict with the keys ['staleness', 'versions'], got {dict_or_type(actual)}"
        actions = pipedream_async(p, n).per_device
        for key in ("versions", "staleness"):
            if not isinstance(actual[key], list) or len(actual[key]) != p:
                return f"{key!r}: expected one list per device ({p}), got {actual[key]!r}"
        for device, acts in enumerate(actions):
            yours, theirs = actual["versions"][device], expected["versions"][device]
            if not isinstance(yours, list) or len(yours) != len(theirs):
                return f"versions of device {device}: expected one per action ({len(theirs)}), got {yours!r}"
            for a, v, w in zip(acts, yours, theirs):
                if v != w:
                    return (f"{a} (micro-batch {a.microbatch} of batch {a.microbatch // batch}): version {v!r}, "
                            f"2BW uses {w}")
            yours, theirs = actual["staleness"][device], expected["staleness"][device]
            backwards = [a for a in acts if a.op == "B"]
            if not isinstance(yours, list) or len(yours) != len(theirs):
                return f"staleness of device {device}: expected one per backward ({len(theirs)}), got {yours!r}"
            for a, v, w in zip(backwards, yours, theirs):
                if v != w:
                    return f"{a}: staleness {v!r}, 2BW's is {w}"
        return None

    return Case(f"p={p}, batch={batch}, batches={batches}", run, lambda: _per_batch_expected(p, batch, n),
                compare=compare,
                hint="walk each device's list in order and count the updates its stage has made: when does a 2BW "
                     "stage update, and which of its versions does a micro-batch of a given batch compute with? "
                     "And which condition does the paper put on the batch size?")


def _random_per_batch_cases(seed: int, count: int) -> list[Case]:
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        p = rng.choice((1, 2, 4, 8))
        cases.append(_per_batch_case(p, rng.randint(max(1, p - 2), 2 * p + 1), rng.randint(1, 3)))
    return cases


def _per_batch_drawn(rng: random.Random) -> list[Case]:
    return _random_per_batch_cases(rng.randrange(10 ** 9), 2)


TWO_BW = Exercise(
    "06.5", "PipeDream-2BW's version rule", "per_batch_versions", 3,
    lambda: [_per_batch_case(2, 2, 3), _per_batch_case(4, 5, 2), _per_batch_case(4, 2, 2)],
    lambda: [_per_batch_case(1, 1, 1), _per_batch_case(1, 1, 4), _per_batch_case(2, 2, 1), _per_batch_case(2, 1, 3),
             _per_batch_case(4, 3, 3), _per_batch_case(4, 4, 3), _per_batch_case(8, 8, 2), _per_batch_case(8, 7, 2),
             _per_batch_case(8, 11, 2)] + _random_per_batch_cases(17, 6),
    forbidden=("gpipe_ref.schedule.WeightPolicy", "gpipe_ref.staleness.version_table",
               "gpipe_ref.staleness.StagedTrainer", "gpipe_ref.schedule.weight_versions",
               "gpipe_ref.simulator.simulate"),
    category="build", drawn=_per_batch_drawn)

EXERCISES = [WARMUP, ONE_F_ONE_B, STASHED, PREDICT_VERSIONS, TWO_BW]
