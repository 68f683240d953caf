"""Judging outside the learner's kernel: what travels as data (wire), what an answer may not call while it
runs (guard) and how a reply is read (judge). Each test plays a learner who tries to get round one of them."""

from __future__ import annotations

import json
import math
import random
import sys
import textwrap
import types

import pytest
import torch

from gpipe_ref.grading import EXERCISES, grade
from gpipe_ref.grading.cases import Case, Exercise, Verdict
from gpipe_ref.grading.judge import judge, run_cases
from gpipe_ref.grading.kernel_side import wire
from gpipe_ref.grading.kernel_side.guard import EXPECTED_VALUES
from gpipe_ref.grading.kernel_side.runner import Request, run_one
from gpipe_ref.schedule import Action

# -- wire: what an answer's result may be, and what the grader accepts back -----------------------------------


def round_trip(value):
    return wire.loads(wire.dumps({"label": "x", "outcome": "returned", "value": wire.encode(value)}))["value"]


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2 ** 70, 0.1, -0.0, 1e308, "", "héllo\n\x00", [], (), {},
    [1, [2.5, [None, "x"]]], (1, (2, (3,))), ((), [()]), {1: "a", 2: (3, 4)}, {(1, 2): [3], "k": {0: None}},
    {True: 1, None: 2, 1.5: 3}, Action("F", 0, 1), [Action("B", 3, 0), (Action("W", 1, 2),)],
], ids=repr)
def test_plain_values_come_back_as_they_were(value):
    back = round_trip(value)
    assert back == value and type(back) is type(value)
    if isinstance(value, dict):
        assert [type(k) for k in back] == [type(k) for k in value]  # int keys stay ints, tuples stay tuples


def test_nan_and_infinities_come_back():
    back = round_trip([float("nan"), float("inf"), float("-inf"), (float("nan"),)])
    assert math.isnan(back[0]) and back[1] == math.inf and back[2] == -math.inf and math.isnan(back[3][0])
    assert type(back[3]) is tuple


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()), ids=str)
def test_tensors_of_every_dtype_come_back(dtype):
    source = torch.tensor([[0, 1, 2], [3, 4, 5]]).to(dtype)
    if dtype.is_floating_point:
        source[0, 0], source[0, 1], source[0, 2] = float("nan"), float("inf"), float("-inf")
    for tensor in (source, source[:, 1:].t(), source[0, 0], source[:0]):  # strided, a scalar, empty
        back = round_trip(tensor)
        assert type(back) is torch.Tensor and back.dtype == dtype and back.shape == tensor.shape
        if dtype.is_floating_point:
            assert torch.equal(back.isnan(), tensor.isnan()) and torch.equal(back.nan_to_num(), tensor.nan_to_num())
        else:
            assert torch.equal(back, tensor)


def test_a_tensor_comes_back_plain_without_grad():
    weight = torch.nn.Parameter(torch.ones(2, 2))
    back = round_trip({"w": weight, "y": (weight * 2).sum()})
    assert type(back["w"]) is torch.Tensor and not back["w"].requires_grad and back["w"].grad_fn is None
    assert back["y"].item() == 8.0 and not back["y"].requires_grad


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Sneaky(torch.Tensor):
    pass


class Evil:
    def __reduce__(self):
        import os

        return os.system, ("echo pwned",)


@pytest.mark.parametrize("value,named", [
    (AlwaysEqual(3), "AlwaysEqual (a subclass of int"),
    ([1, AlwaysEqual(3)], "AlwaysEqual (a subclass of int"),
    (torch.ones(2).as_subclass(Sneaky), "Sneaky (a subclass of Tensor"),
    (type("MyList", (list,), {})([1]), "MyList (a subclass of list"),
    (type("MyStr", (str,), {})("0F0"), "MyStr (a subclass of str"),
    (lambda: 1, "a function"),
    (Evil(), "Evil"),
    ({"k": Evil()}, "Evil"),
    ({Evil(): 1}, "Evil"),
    (torch.ones(2, dtype=torch.complex64), "complex64"),
    (torch.ones(2).to_sparse(), "sparse"),
    (range(3), "a range"),
], ids=lambda v: type(v).__name__ if not isinstance(v, str) else v[:20])
def test_anything_else_is_refused_naming_its_type(value, named):
    with pytest.raises(wire.Refused) as refused:
        wire.encode(value)
    assert named in str(refused.value)


def test_library_number_types_travel_as_plain_values():
    assert wire.decode(wire.encode(torch.Size([2, 3]))) == (2, 3)
    numpy = pytest.importorskip("numpy")
    for value, plain in ((numpy.float64(0.25), 0.25), (numpy.int64(3), 3), (numpy.bool_(True), True)):
        decoded = wire.decode(wire.encode(value))
        assert decoded == plain and type(decoded) is type(plain)
    with pytest.raises(wire.Refused):
        wire.encode(type("Sly", (numpy.float64,), {})(0.5))  # a subclass of numpy's type is not numpy's type


def test_a_value_that_contains_itself_or_is_too_deep_is_refused():
    loop: list = []
    loop.append(loop)
    with pytest.raises(wire.Refused, match="nested more than"):
        wire.encode(loop)
    with pytest.raises(wire.Refused, match="elements in all"):
        wire.encode([torch.zeros(wire.MAX_ELEMENTS), torch.zeros(1)])


@pytest.mark.parametrize("text", [
    "{", "[1]", "null", '"outcome"', '{"value": 1}', '{"outcome": 3}', '{"outcome": "returned", "value": NaN}',
    '{"outcome": "returned", "value": Infinity}',
    '{"outcome": "returned", "value": {"$pickle": "gASV"}}',
    '{"outcome": "returned", "value": {"$tuple": [1], "$dict": []}}',
    '{"outcome": "returned", "value": {"$tuple": 1}}',
    '{"outcome": "returned", "value": {"$dict": [[1]]}}',
    '{"outcome": "returned", "value": {"$dict": [[[1, 2], 3]]}}',
    '{"outcome": "returned", "value": {"$float": "1.5"}}',
    '{"outcome": "returned", "value": {"$action": ["X", 0, 0]}}',
    '{"outcome": "returned", "value": {"$action": ["F", -1, 0]}}',
    '{"outcome": "returned", "value": {"$action": ["F", true, 0]}}',
    '{"outcome": "returned", "value": {"$action": ["F", 0]}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [2, 3], "data": [1, 2]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [-1], "data": [1]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [true], "data": [1]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": 2, "data": [1, 2]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "complex64", "shape": [1], "data": [1]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [1], "data": ["x"]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [1], "data": [[1]]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "int8", "shape": [1], "data": [300]}}}',
    '{"outcome": "returned", "value": {"$tensor": {"dtype": "float32", "shape": [1]}}}',
    '{"outcome": "returned", "value": ' + "[" * 100 + "]" * 100 + "}",
    "[" * 100_000 + "]" * 100_000,
], ids=lambda t: t[-60:])
def test_malformed_replies_are_refused_by_the_grader(text):
    with pytest.raises(wire.Malformed):
        wire.loads(text)


def test_the_grader_reads_text_only_and_not_too_much():
    for not_text in (None, b'{"outcome": "returned"}', {"outcome": "returned"}):
        with pytest.raises(wire.Malformed, match="expected JSON text"):
            wire.loads(not_text)
    with pytest.raises(wire.Malformed, match="at most"):
        wire.loads('{"outcome": "returned", "value": "' + "x" * (wire.MAX_CHARS + 2000) + '"}')


def test_a_result_over_the_limit_becomes_a_short_refusal():
    text = wire.dumps({"exercise": "07.2", "label": "p=3, m=4", "outcome": "returned",
                       "value": "x" * (wire.MAX_CHARS + 1)})
    assert len(text) < 300
    reply = wire.loads(text)
    assert reply["outcome"] == "refused" and reply["label"] == "p=3, m=4" and "value" not in reply
    huge = _namespace("def my_schedule(p, m):\n    return 'x' * (17 * 2 ** 20)\n")
    verdict = grade("07.2", huge)
    assert verdict.status == "failed" and verdict.points == 0 and "characters as data" in verdict.feedback


def test_a_refused_result_loses_the_points_with_its_reason():
    namespace = {"AlwaysEqual": AlwaysEqual}
    exec("def uneven_step_time(batch, m, p, overhead, per_row):\n    return AlwaysEqual(0)\n", namespace)
    reply = run_one(Request.of(EXERCISES["04.3"], EXERCISES["04.3"].cases()[0]), namespace, 5)
    assert reply["outcome"] == "refused" and "AlwaysEqual" in reply["error"] and "value" not in reply
    verdict = grade("04.3", namespace)
    assert verdict.points == 0 and "AlwaysEqual (a subclass of int" in verdict.feedback

    ran = []
    namespace = {"Evil": type("Evil", (), {"__reduce__": lambda self: (ran.append, ("unpickled",))})}
    exec("def bubble_fraction(forward_times, backward_times, m, comm):\n    return Evil()\n", namespace)
    verdict = grade("04.2", namespace)
    assert verdict.points == 0 and "Evil" in verdict.feedback and ran == []


# -- guard: the forbidden functions and the expected values, whatever path reaches them ------------------------

PRELUDE = "import torch\nfrom gpipe_ref import Action\n"
GPIPE = "gpipe_ref.schedule.gpipe"
RIGHT_GPIPE = "[[Action('F', d, k) for k in range(m)] + [Action('B', d, k) for k in range(m)] for d in range(p)]"
RIGHT_STEP = ("(lambda t: 3 * (sum(t) + (p - 1) * max(t)))"
              "([overhead + per_row * (batch // m + (k < batch % m)) for k in range(m)])")  # 04.3's prediction


def _namespace(code: str, **extra) -> dict:
    namespace: dict = {"LABEL": "batch={batch}, m={m}, p={p}, overhead={overhead}, per_row={per_row}", **extra}
    exec(compile(PRELUDE + textwrap.dedent(code), "<answer>", "exec"), namespace)
    return namespace


def _helpers() -> types.ModuleType:
    """A module of the learner's own, written elsewhere: the answer's code does not name gpipe."""
    module = types.ModuleType("my_helpers")
    exec("from gpipe_ref import schedule\n"
         "def per_device(p, m):\n    return [list(a) for a in getattr(schedule, 'gp' + 'ipe')(p, m).per_device]\n",
         module.__dict__)
    return module


GPIPE_ATTEMPTS = {
    "a helper defined elsewhere": ("""
        def gpipe_actions(p, m):
            return helpers.per_device(p, m)
        """, {"helpers": _helpers()}),
    "getattr(gpipe_ref, 'gpipe')": ("""
        import gpipe_ref
        def gpipe_actions(p, m):
            return [list(a) for a in getattr(gpipe_ref, "gp" + "ipe")(p, m).per_device]
        """, {}),
    "importlib": ("""
        import importlib
        def gpipe_actions(p, m):
            module = importlib.import_module("gpipe_ref." + "schedule")
            return [list(a) for a in vars(module)["gp" + "ipe"](p, m).per_device]
        """, {}),
    "a reference captured before the answer runs": ("""
        from gpipe_ref import schedule
        TOOLS = {"build": schedule.gpipe}
        del schedule
        def gpipe_actions(p, m):
            return [list(a) for a in TOOLS["build"](p, m).per_device]
        """, {}),
    "a thread started in the answer": (f"""
        import threading
        from gpipe_ref import schedule
        TOOLS = [schedule.gpipe]
        del schedule
        def gpipe_actions(p, m):
            out = []
            worker = threading.Thread(target=lambda: out.append([list(a) for a in TOOLS[0](p, m).per_device]))
            worker.start()
            worker.join()
            return out[0] if out else {RIGHT_GPIPE}
        """, {}),
    "catching ForbiddenCall and returning a right value": (f"""
        from gpipe_ref import schedule
        TOOLS = [schedule.gpipe]
        del schedule
        def gpipe_actions(p, m):
            try:
                TOOLS[0](p, m)
            except BaseException:
                pass
            return {RIGHT_GPIPE}
        """, {}),
    "make_schedule by name": ("""
        import gpipe_ref.schedule as s
        def gpipe_actions(p, m):
            return [list(a) for a in getattr(s, "make_" + "schedule")("gpipe", p, m).per_device]
        """, {}),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the refused thread
@pytest.mark.parametrize("attempt", list(GPIPE_ATTEMPTS))
def test_a_forbidden_function_is_refused_on_every_path(attempt):
    code, extra = GPIPE_ATTEMPTS[attempt]
    namespace = _namespace(code, **extra)
    ex = EXERCISES["04.1"]
    reply = run_one(Request.of(ex, ex.cases()[0]), namespace, 10)
    assert reply["outcome"] == "forbidden" and reply["name"].startswith("gpipe_ref.schedule."), reply
    assert "value" not in reply
    verdict = grade("04.1", namespace)
    assert verdict.status == "failed" and verdict.points == 0 and "gpipe_ref.schedule." in verdict.feedback


def test_a_refused_call_then_a_hang_is_reported_as_the_refused_call():
    """Found on Python 3.12 (a GPU machine): a thread's refused call, then an answer waiting for that thread past the
    case's time limit, was reported as a timeout. The refused call is the verdict, whatever follows it."""
    namespace = _namespace("""
        import time
        from gpipe_ref import schedule
        TOOLS = [schedule.gpipe]  # out of the answer's own names: only the watch on calls sees it
        del schedule
        def gpipe_actions(p, m):
            try:
                TOOLS[0](p, m)
            except Exception:
                pass
            while True:
                time.sleep(0.05)
        """)
    reply = run_one(Request.of(EXERCISES["04.1"], EXERCISES["04.1"].cases()[0]), namespace, 1)
    assert reply["outcome"] == "forbidden" and reply["name"] == "gpipe_ref.schedule.gpipe", reply


@pytest.mark.xfail(sys.version_info < (3, 12), strict=True,
                   reason="Python 3.11 has no threading.setprofile_all_threads: a thread started before the answer "
                          "runs unwatched (docs/instructors.md, the threat model, says so)")
def test_a_thread_started_before_the_answer_is_refused_too():
    namespace = _namespace("""
        import threading
        from gpipe_ref import schedule
        TOOLS, asked, done, out = [schedule.gpipe], threading.Event(), threading.Event(), []
        del schedule
        def work():
            asked.wait(10)
            out.append([list(a) for a in TOOLS[0](2, 2).per_device])
            done.set()
        threading.Thread(target=work, daemon=True).start()
        def gpipe_actions(p, m):
            asked.set()
            done.wait(10)
            return out[0]
        """)
    assert run_one(Request.of(EXERCISES["04.1"], EXERCISES["04.1"].cases()[0]), namespace, 10)["outcome"] == "forbidden"


def test_the_right_answer_beside_them_passes():
    assert grade("04.1", _namespace(f"def gpipe_actions(p, m):\n    return {RIGHT_GPIPE}\n")).passed
    assert grade("04.3", _namespace(f"def uneven_step_time(batch, m, p, overhead, per_row):\n"
                                    f"    return {RIGHT_STEP}\n")).passed


SIZES_ATTEMPTS = {  # 04.3's answers that reach what they may not; LABEL is 04.3's case label
    "the method form x.tensor_split": ("""
        def uneven_step_time(batch, m, p, overhead, per_row):
            return 3 * (batch + (p - 1) * len(torch.arange(batch).tensor_split(m)[0])) * per_row
        """, "torch.tensor_split"),
    "torch.tensor_split by name": ("""
        def uneven_step_time(batch, m, p, overhead, per_row):
            return 3 * (batch + (p - 1) * len(getattr(torch, "tensor" + "_split")(torch.arange(batch), m)[0])) * per_row
        """, "torch.tensor_split"),
    "the stack's case.expected() (sys._getframe)": ("""
        import sys
        def uneven_step_time(batch, m, p, overhead, per_row):
            frame = sys._getframe(1)
            while "case" not in frame.f_locals:
                frame = frame.f_back
            return frame.f_locals["case"].expected()
        """, None),
    "the stack's case.expected() (inspect.stack)": ("""
        import inspect
        def uneven_step_time(batch, m, p, overhead, per_row):
            case = next(info.frame.f_locals["case"] for info in inspect.stack() if "case" in info.frame.f_locals)
            return case.expected()
        """, None),
    "EXERCISES[...].all_cases()": ("""
        def uneven_step_time(batch, m, p, overhead, per_row):
            from gpipe_ref.grading import EXERCISES
            label = LABEL.format(**locals())
            case = next(c for c in EXERCISES["04.3"].all_cases() if c.label == label)
            return case.expected()
        """, "the grader's expected values"),
    "another exercise's expected value": (f"""
        def uneven_step_time(batch, m, p, overhead, per_row):
            from gpipe_ref.grading import EXERCISES
            EXERCISES["06.1"].cases()[0].expected()
            return {RIGHT_STEP}
        """, "the grader's expected values"),
    "a copy of expected's code (it calls sizes)": ("""
        import types
        def uneven_step_time(batch, m, p, overhead, per_row):
            from gpipe_ref.grading import EXERCISES
            label = LABEL.format(**locals())
            e = next(c for c in EXERCISES["04.3"].all_cases() if c.label == label).expected
            return types.FunctionType(e.__code__.replace(co_name="mine"), e.__globals__, closure=e.__closure__)()
        """, "the grader's expected values"),  # the copy has expected's file, line and bytecode
}


@pytest.mark.parametrize("attempt", list(SIZES_ATTEMPTS))
def test_expected_values_and_builtins_are_refused_while_the_answer_runs(attempt):
    code, name = SIZES_ATTEMPTS[attempt]
    namespace = _namespace(code)
    ex = EXERCISES["04.3"]
    reply = run_one(Request.of(ex, ex.cases()[1]), namespace, 10)
    if name is None:  # the kernel's runner keeps no case in its frames: the walk finds nothing to call
        assert reply["outcome"] == "raised" and "value" not in reply, reply
        name = EXPECTED_VALUES  # grade() runs in one process: run_cases's frame holds the case, and the guard
    else:
        assert reply == {"exercise": "04.3", "label": ex.cases()[1].label, "outcome": "forbidden", "name": name}
    verdict = grade("04.3", namespace)
    shown = "called a case's expected value" if name == EXPECTED_VALUES else name
    assert verdict.status == "failed" and verdict.points == 0 and shown in verdict.feedback


def test_every_case_expected_is_guarded_and_callable_outside():
    """The guard knows expected by its code: all_cases() builds new functions of the same code, whatever the draw."""
    from gpipe_ref.grading.kernel_side.runner import expected_codes

    for ex in EXERCISES.values():
        for case in ex.all_cases(random.Random(7)):
            assert case.expected.__code__ in expected_codes(), (ex.id, case.label)
    assert EXERCISES["04.3"].cases()[1].expected() == 78.0  # outside an answer the grader calls it


def test_a_rank_launched_by_the_answer_is_guarded_too():
    namespace = _namespace("""
        import torch.distributed as dist
        import gpipe_ref.distributed.data_parallel as dp
        def average_gradients(model):
            getattr(dp, "naive_data_parallel" + "_step")(model, None, None, None, None)
        """)
    ex = EXERCISES["01.1"]
    reply = run_one(Request.of(ex, ex.cases()[0]), namespace, 40)
    assert reply["outcome"] == "forbidden", reply
    assert reply["name"] == "gpipe_ref.distributed.data_parallel.naive_data_parallel_step"


def test_a_rank_that_catches_the_refusal_is_still_refused():
    """Ranks start clean (launch never forks the kernel): the runner sends the guard to them, and a rank whose
    answer catches ForbiddenCall and returns fails all the same."""
    namespace = _namespace("""
        import torch.distributed as dist
        import gpipe_ref.distributed.data_parallel as dp
        def average_gradients(model):
            try:
                getattr(dp, "naive_data_parallel" + "_step")(model, None, None, None, None)
            except Exception:
                pass
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        """)
    ex = EXERCISES["01.1"]
    reply = run_one(Request.of(ex, ex.cases()[0]), namespace, 40)
    assert reply["outcome"] == "forbidden", reply
    assert reply["name"] == "gpipe_ref.distributed.data_parallel.naive_data_parallel_step"


def test_a_generic_wrapper_of_a_forbidden_class_is_not_refused():
    """DistributedDataParallel's methods are wrapped by torch._disable_dynamo, as is torch.manual_seed once
    torch._dynamo is imported: a right answer that seeds must not be refused as using DDP."""
    import torch._dynamo  # noqa: F401  (what torch.utils.checkpoint or torch.compile import)

    namespace = _namespace("""
        import torch.distributed as dist
        def average_gradients(model):
            torch.manual_seed(0)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        """)
    ex = EXERCISES["01.1"]
    assert run_one(Request.of(ex, ex.cases()[0]), namespace, 40)["outcome"] == "returned"


def test_the_guard_is_gone_after_the_answer():
    import sys
    import threading

    before = sys.getprofile(), threading.getprofile()
    namespace = _namespace("import gpipe_ref\ndef gpipe_actions(p, m):\n    return getattr(gpipe_ref, 'gpipe')(p, m)\n")
    assert run_one(Request.of(EXERCISES["04.1"], EXERCISES["04.1"].cases()[0]), namespace, 5)["outcome"] == "forbidden"
    assert (sys.getprofile(), threading.getprofile()) == before
    from gpipe_ref.schedule import gpipe

    assert gpipe(2, 2).num_microbatches == 2  # the grader's own code may call it again


# -- judge: only the outcome and the value are read, and points stay within the exercise's -----------------------

def _toy_cases() -> list[Case]:
    return [Case("a", lambda f: f(1), lambda: 2), Case("b", lambda f: f(2), lambda: 4)]


TOY = Exercise("99.1", "toy", "f", 3, _toy_cases, lambda: [])


def _ask(replies):
    return lambda index: replies[index]


def test_forged_points_or_status_in_a_reply_are_ignored():
    cases = TOY.cases()
    wrong = [{"label": c.label, "outcome": "returned", "value": 0, "points": 100, "status": "passed",
              "max_points": 100, "passed": True} for c in cases]
    verdict = run_cases(TOY, cases, _ask(wrong))
    assert verdict.status == "failed" and verdict.points == 0 and verdict.max_points == 3
    right = [{**w, "value": v} for w, v in zip(wrong, (2, 4))]
    verdict = run_cases(TOY, cases, _ask(right))
    assert verdict.passed and verdict.points == 3 and verdict.max_points == 3


def test_points_never_exceed_the_exercise_maximum():
    assert Verdict("99.1", "toy", "passed", 10 ** 9, 3, "").points == 3
    assert Verdict("99.1", "toy", "failed", 3, 3, "").points == 0
    assert Verdict("99.1", "toy", "passed", -5, 3, "").points == 0
    for ex in EXERCISES.values():
        forged = run_cases(ex, ex.cases(), lambda index: {"outcome": "passed", "points": 10 ** 6})
        assert forged.points == 0 and forged.max_points == ex.points


def test_a_reply_for_another_case_is_an_error():
    cases = TOY.cases()
    verdict = run_cases(TOY, cases, _ask([{"label": "b", "outcome": "returned", "value": 2}] * 2))
    assert verdict.status == "error" and verdict.points == 0 and "another case" in verdict.feedback
    assert judge(TOY, cases[0], {"outcome": "returned", "value": 2}) == (
        "error", "case a: the kernel answered for another case ('None')")


@pytest.mark.parametrize("outcome", ["passed", "ok", "", None, 3, "no such case", "RETURNED"])
def test_an_unknown_outcome_scores_zero_with_a_clear_reason(outcome):
    status, feedback = judge(TOY, TOY.cases()[0], {"label": "a", "outcome": outcome, "value": 2})
    assert status == "error"
    assert feedback == f"case a: a malformed result (outcome {str(outcome)[:40]!r})"
    verdict = run_cases(TOY, TOY.cases(), _ask([{"label": c.label, "outcome": outcome, "value": 2 * (i + 1)}
                                                for i, c in enumerate(TOY.cases())]))
    assert verdict.points == 0 and not verdict.passed


def test_a_malformed_reply_is_an_error_not_a_crash():
    def ask(index):
        return wire.loads('{"label": "a", "outcome": "returned", "value": {"$pickle": "x"}}')

    verdict = run_cases(TOY, TOY.cases(), ask)
    assert verdict.status == "error" and verdict.points == 0 and "malformed result" in verdict.feedback


def test_a_compare_that_raises_is_a_failure_with_a_reason():
    case = Case("c", lambda f: f(), lambda: 1, compare=lambda actual, expected: actual["missing"])
    status, feedback = judge(TOY, case, {"label": "c", "outcome": "returned", "value": [1]})
    assert status == "failed" and feedback.startswith("case c: could not compare the result: TypeError")


def test_the_reply_is_json_text_that_names_its_case():
    ex = EXERCISES["04.3"]
    case = ex.cases()[1]
    answer = _namespace(f"def uneven_step_time(batch, m, p, overhead, per_row):\n    return {RIGHT_STEP}\n")
    text = wire.dumps(run_one(Request.of(ex, case), answer, 5))
    assert json.loads(text) == {"exercise": "04.3", "label": case.label, "outcome": "returned", "value": 78.0}
    assert judge(ex, case, wire.loads(text)) is None
