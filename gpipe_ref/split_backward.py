"""A stage's backward through autograd, split into B, the activation gradients, and W, the weight gradients (Qi et al.
2024, sec. 2), for any stage a user brings.

B asks autograd for the gradient of the stage input (what the previous stage needs) and keeps the gradient of
each *boundary node*'s outputs: a node on the activation path (it reaches the stage input) with a child that
reaches only weights. W starts from those nodes and goes down the weights' side alone, so it repeats none of B's
work. The boundary is found in the autograd graph itself, not from the modules: whatever a layer does (an in-place
activation, a hook, a parametrization, a custom autograd Function, a weight used twice, a tensor it holds) is in
the graph, so B and W together give the gradients ``loss.backward()`` gives. A weight reached through several
boundary nodes (used twice in the stage) takes its W from the stage's output instead, as a whole backward would.
torch.distributed.pipelining splits a stage's backward the same way (``stage_backward_input`` and
``stage_backward_weight``).

Walking the graph and calling autograd once more per weight cost tens of microseconds each on a CPU, a large part
of a small stage's step. So a *plain stage* skips both: every layer is an ``nn.Linear`` run as ``F.linear`` (its
class's forward, no module hook, its own leaf weight and bias with no tensor hook) or a built-in ``torch.nn``
module without trainable parameters or hooks. Its graph then holds nothing but those layers' operations, its
boundary nodes are the Linears' output nodes, and W forms each weight gradient as the matrix product itself
(:func:`linear_weight_grads`), from the input the forward recorded (its version counter unchanged) and the output
gradient B kept, all in one dtype. The loss on the last stage is walked (a loss may hold a weight of its own, or
hook the output); a Linear output that is a view (an in-place layer would move its history) or that got no gradient
leaves the stage to the graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["ForwardMarks", "WeightPass", "backward_input", "backward_weight", "linear_weight_grads", "plain_stage"]


# -- plain stages: what the modules prove ------------------------------------------------------------------------
def _hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks)


def _global_hooks() -> bool:
    """Whether a hook is registered for every module (``torch.nn.modules.module.register_module_*_hook``)."""
    return bool(torch.nn.modules.module._global_forward_pre_hooks or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_backward_pre_hooks
                or torch.nn.modules.module._global_backward_hooks)


def _built_in(m: nn.Module) -> bool:
    return type(m).__module__.startswith("torch.nn.modules.") and "forward" not in m.__dict__ and not _hooks(m)


def _linear(layer: nn.Module) -> tuple | None:
    """``(weight, bias)`` of an ``nn.Linear`` whose output is ``F.linear(input, weight, bias)`` with its own leaf
    parameters (plain ``nn.Parameter``s), trainable, without tensor hooks and with dense gradients; None
    otherwise."""
    if type(layer) is not nn.Linear or not _built_in(layer):
        return None
    weight, bias = layer._parameters.get("weight"), layer._parameters.get("bias")
    params = [p for p in (weight, bias) if p is not None and p.requires_grad]
    if type(weight) is not nn.Parameter or (bias is not None and type(bias) is not nn.Parameter):
        return None  # a Parameter subclass may change what F.linear computes (__torch_function__)
    if not params or any(p._backward_hooks or p._post_accumulate_grad_hooks
                                           or (p.grad is not None and p.grad.layout != torch.strided) for p in params):
        return None
    return weight, bias


def plain_stage(layers: Sequence[nn.Module]) -> list | None:
    """Per layer, ``(weight, bias)`` of a plain Linear or None for a built-in layer without trainable parameters,
    when every layer is one or the other and no module hook is registered globally; else None (see the module
    docstring)."""
    if _global_hooks():
        return None
    plan = []
    for layer in layers:
        linear = _linear(layer)
        if linear is None and not all(_built_in(m) and not any(p.requires_grad for p in m.parameters(recurse=False))
                                      for m in layer.modules()):
            return None
        plan.append(linear)
    return plan


@dataclass(slots=True)
class ForwardMarks:
    """What a stage's forward records for its backward: for a plain stage, each Linear's output node, input, input
    version, weight and bias; with no input gradient to form, the first layer output computed from a weight (where
    B's activation path starts: its tensors and their edges); the last layer output (where a loss begins)."""

    plan: list | None  # plain_stage(layers), or None
    want_anchors: bool
    anchors: list = field(default_factory=list)  # (tensor, its gradient edge)
    products: list = field(default_factory=list)  # (output node, input, its version, weight, bias) per Linear
    output: object = None

    def after(self, j: int, x, out) -> None:
        """Layer ``j`` turned ``x`` into ``out``: mark it before a later layer changes ``out`` in place."""
        self.output = out
        if self.want_anchors and not self.anchors and self.plan is None:  # a plain stage needs none; a leaf (a
            # parameter handed on as it is) is no anchor
            self.anchors += [(t, get_gradient_edge(t)) for t in (out if isinstance(out, tuple) else (out,))
                             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if self.plan is not None and self.plan[j] is not None:
            weight = self.plan[j][0]
            if type(out) is torch.Tensor and type(x) is torch.Tensor and out.grad_fn is not None \
                    and not out._is_view() and x.dtype == out.dtype == weight.dtype:
                self.products.append((out.grad_fn, x, x._version, *self.plan[j]))
            else:  # autocast, a tensor subclass, or a view (an in-place change moves its history): the graph decides
                self.plan = None


# -- B and W -----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class WeightPass:
    """What B leaves for W: per group of leaves, where W starts and with which gradients, or a Linear's products."""

    groups: list = field(default_factory=list)  # (leaves, starts, their grads)
    products: list = field(default_factory=list)  # (input, its version, weight, bias, output gradient)
    keep_graph: bool = False  # a group starts from the stage's output: later groups run through its nodes


def _walk(roots: Sequence[Node], stop: set[Node], anchors: set[Node]):
    """Every node under ``roots`` (not below a ``stop`` node), each after its children: whether it reaches an
    anchor (``on_path``), the leaves under it (``reach``, a bit per leaf), its children, and each node's outputs
    other than the first that a parent uses. Iterative: a deep stage would overflow Python's recursion."""
    kids: dict[Node, list[Node]] = {}
    on_path: dict[Node, bool] = {}
    reach: dict[Node, int] = {}
    leaves: list[torch.Tensor] = []
    outputs: dict[Node, set[int]] = {}
    order: list[Node] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in on_path:
            continue
        children = kids.get(node)
        if children is None:
            children = kids[node] = []
            if node not in stop:
                for child, nr in node.next_functions:
                    if child is not None:
                        children.append(child)
                        if nr:
                            outputs.setdefault(child, set()).add(nr)
            pending = [c for c in children if c not in on_path]
            if pending:
                stack.append(node)
                stack += pending
                continue
        path, bits = node in anchors, 0
        if children:
            for c in children:
                path = path or on_path[c]
                bits |= reach[c]
        elif node not in stop and hasattr(node, "variable"):  # AccumulateGrad: a leaf, a weight
            bits = 1 << len(leaves)
            leaves.append(node.variable)
        on_path[node], reach[node] = path, bits
        order.append(node)
    return order, kids, on_path, reach, leaves, outputs


def _groups(roots, grads, root_edges, anchors: set[Node], stop: set[Node]):
    """The boundary nodes grouped by the leaves they reach (a weight used twice joins its nodes), the outputs off
    the activation path that reach leaves (W starts at them too), the leaves, and the nodes' used outputs."""
    order, kids, on_path, reach, leaves, outputs = _walk([e.node for e in root_edges], stop, anchors)
    starts = []  # [mask, nodes, roots]
    for node in order:
        if on_path[node]:
            bits = 0
            for c in kids[node]:
                if not on_path[c]:
                    bits |= reach[c]
            if bits:
                starts.append([bits, [node], []])
    for r, g, edge in zip(roots, grads, root_edges):
        if not on_path[edge.node] and reach[edge.node]:
            starts.append([reach[edge.node], [], [(r, g)]])
        elif edge.output_nr:
            outputs.setdefault(edge.node, set()).add(edge.output_nr)
    groups: list[list] = []
    for start in starts:
        joined = [g for g in groups if g[0] & start[0]]
        for g in joined:
            start[0] |= g[0]
            start[1] += g[1]
            start[2] += g[2]
        groups = [g for g in groups if not g[0] & start[0]] + [start]
    return groups, leaves, outputs


def _loss_adds_nothing(roots: Sequence[torch.Tensor], output) -> bool:
    """Whether the nodes between ``roots`` and the stage output (a loss's operations) reach no leaf of their own,
    and no hook sits on the output (a loss may register one): then a plain stage's graph is its layers' alone."""
    outputs = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
    if any(t._backward_hooks for t in outputs):
        return False
    if all(any(r is t for t in outputs) for r in roots):  # B starts from the stage output itself
        return True
    stop = {get_gradient_edge(t).node for t in outputs if t.requires_grad}
    return not _walk([get_gradient_edge(r).node for r in roots], stop, set())[4]


def _engine(roots, grads, targets, keep_graph: bool, accumulate: bool):
    """``torch.autograd.grad`` (or ``.backward`` with ``accumulate``) without its argument checks, which cannot
    fail here and cost a few microseconds a call: B and W make several calls per stage and micro-batch."""
    return torch.autograd.Variable._execution_engine.run_backward(tuple(roots), tuple(grads), keep_graph, False,
                                                                  tuple(targets), True, accumulate)


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   marks: ForwardMarks | None = None) -> tuple[tuple, WeightPass]:
    """B: the gradients of ``inputs`` (tensors that require grad; ``None`` where the roots do not depend on one)
    from ``roots`` with gradients ``grads``, and what W needs. With no input, the activation path starts at the
    first layer output that ``marks`` recorded: B then forms the activation gradients down to it."""
    if not roots:  # the stage's output requires no grad: nothing flows back
        return (None,) * len(inputs), WeightPass()
    if marks is not None and marks.plan is not None and _loss_adds_nothing(roots, marks.output):
        done = _backward_plain(roots, grads, inputs, marks)
        if done is not None:
            return done
    root_edges = [get_gradient_edge(r) for r in roots]
    input_nodes = [get_gradient_edge(t).node for t in inputs]
    # An anchor's gradient is captured, not run through its node, so after the tensor's hooks: W, which runs the
    # node, would apply them again. With a hook there, the activation path is left empty: W does it all.
    anchors = [] if marks is None or any(t._backward_hooks for t, _ in marks.anchors) else marks.anchors
    path = set(input_nodes) | {edge.node for _, edge in anchors}
    groups, leaves, outputs = _groups(roots, grads, root_edges, path, set(input_nodes))
    # every output of each boundary node is captured as an edge: the engine hands the gradients back with the
    # input gradients, and no Python runs inside the backward
    kept = [GradientEdge(node, i) for _, nodes, _ in groups for node in nodes for i in (0, *outputs.get(node, ()))]
    found = _engine(roots, grads, (*inputs, *kept), True, False) if inputs or kept else ()
    saved: dict[Node, dict[int, torch.Tensor]] = {}
    for edge, g in zip(kept, found[len(inputs):]):
        if g is not None:
            saved.setdefault(edge.node, {})[edge.output_nr] = g
    weight_pass = WeightPass()
    for mask, nodes, root_seeds in groups:
        params = [leaves[i] for i in range(mask.bit_length()) if mask >> i & 1]
        if len(nodes) > 1:  # a weight reached through several boundary nodes, one maybe under another: starting
            # from each would add what flows from the upper one to what B kept at the lower one, which holds it
            # already. So W starts from the stage's output, as a whole backward would, into these weights only.
            weight_pass.groups.append((params, list(roots), list(grads)))
            weight_pass.keep_graph = True
            continue
        starts = [GradientEdge(node, i) for node in nodes for i in saved.get(node, ())]
        start_grads = [saved[node][i] for node in nodes for i in saved.get(node, ())]
        starts += [r for r, _ in root_seeds]
        start_grads += [g for _, g in root_seeds]
        if starts:
            weight_pass.groups.append((params, starts, start_grads))
    return tuple(found[:len(inputs)]), weight_pass


def _backward_plain(roots, grads, inputs, marks: ForwardMarks) -> tuple[tuple, WeightPass] | None:
    """B of a plain stage: the input gradients and each Linear's output gradient, in one call, with no walk. None,
    leaving it to the graph, where a Linear's output got no gradient (its output unused, or its node left the graph)."""
    kept = [GradientEdge(node, 0) for node, *_ in marks.products]
    found = _engine(roots, grads, (*inputs, *kept), True, False) if inputs or kept else ()
    if any(g is None for g in found[len(inputs):]):
        return None
    products = [(x, version, weight, bias, g) for (_, x, version, weight, bias), g
                in zip(marks.products, found[len(inputs):])]
    return tuple(found[:len(inputs)]), WeightPass(products=products)


def backward_weight(kept: WeightPass, locked: bool = False) -> None:
    """W: the leaves' gradients, accumulated into ``.grad`` as ``loss.backward()`` does (their hooks run). With
    ``locked`` (device threads), a Linear's products are added through autograd's accumulation too, which holds a
    lock per gradient: another thread may add into the same ``.grad`` (a weight its loss uses)."""
    for x, version, weight, bias, g in kept.products:
        if x._version != version:  # autograd refuses this too: the plain model's backward fails the same way
            raise RuntimeError("a Linear's input was modified by an in-place operation after the Linear ran: "
                               "autograd needs it for the weight gradient (loss.backward() on the plain model "
                               "fails the same way); use an out-of-place operation there")
        linear_weight_grads(weight, bias, x, g, locked)
    for params, starts, grads in kept.groups:
        _engine(starts, grads, params, kept.keep_graph, True)


def linear_weight_grads(weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, g: torch.Tensor,
                        locked: bool = False) -> None:
    """W of a Linear as the matrix products themselves: for z = x A^T + b, dA = g^T x and db = g^T 1, the sum of g
    over the rows (Qi et al. 2024, sec. 2: W is the weight-gradient product, run apart from B). From the second
    micro-batch on they accumulate straight into ``.grad`` (``addmm_``, ``addmv_``, as Megatron-LM's gradient
    accumulation fusion does), where autograd would form them and then add them; ``locked`` hands them to
    autograd's accumulation instead. A new ``.grad`` has the weight's strides, as autograd gives it. The sums round
    differently from loss.backward()'s in the last bits."""
    if g.dim() != 2:
        g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    gt, x = g.t(), x.detach()
    if locked:
        pairs = [(p, grad) for p, grad in ((weight, lambda: gt @ x), (bias, lambda: g.sum(0)))
                 if p is not None and p.requires_grad]
        _engine([p for p, _ in pairs], [grad() for _, grad in pairs], (), False, True)
        return
    if weight.requires_grad:
        if weight.grad is None:
            weight.grad = torch.mm(gt, x, out=torch.empty_like(weight, memory_format=torch.preserve_format))
        else:
            weight.grad.addmm_(gt, x)
    if bias is not None and bias.requires_grad:
        if bias.grad is None:
            bias.grad = g.sum(0)
        else:
            bias.grad.addmv_(gt, _ones(g.shape[0], g.dtype, g.device))


@functools.lru_cache(maxsize=64)
def _ones(rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(rows, dtype=dtype, device=device)
