"""The per-layer decision of :func:`keras_ext.apply_policy`: compute and storage dtype, why, and casts.

The core decides (:class:`mp_callbacks.policy.PrecisionPolicy`; composites by
:meth:`~mp_callbacks.policy.PrecisionPolicy.explain_composite`); this module walks a Keras model and
applies the rules in order:

* a *composite* (a layer that holds sublayers and runs them in its own ``call``: keras_hub's
  ``TransformerDecoder``, ``MultiHeadAttention``, a subclassed model) computes what it holds: low
  precision when one of its sublayers does;
* an FP32 module rule on a composite holds for its whole subtree (sublayers without a rule of their own);
* a leaf: a module rule, else a model output (``output=``), else its op (softmax, norms, embeddings and
  unknown layers FP32; passthroughs such as ``Dropout`` follow their composite);
* a sublayer computing in another dtype than its composite casts its outputs to the composite's dtype
  (:func:`mp_callbacks.policy.boundary_cast`): an FP32 softmax inside a bf16 attention hands bf16 back.

Layers that a graph model (Functional, Sequential, keras_hub backbones) connects need no casts: each
layer's call casts its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras

from mp_callbacks.policy import PrecisionPolicy, boundary_cast, class_names

from ..global_policy import keras_dtype_policy
from ..layers import children, is_graph

__all__ = ["MATMUL_LAYERS", "LayerPlan", "make_plan", "output_layers"]

MATMUL_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D, keras.layers.Conv2D,
                 keras.layers.Conv3D)
"""The matmul layer classes (what :func:`keras_ext.policy.report.low_precision_share` counts)."""

# Activation names that the core treats as FP32 ops when used as a layer.
_ACTIVATION_OPS = {"softmax": "softmax", "log_softmax": "log_softmax", "exponential": "exp", "softplus": "softplus"}


@dataclass
class LayerPlan:
    """One layer's decision: ``compute``/``params`` dtypes, ``why``, and ``outputs``: the dtype its outputs are
    cast to (its composite's dtype, or ``output=`` for a composite producing a model output; None: no cast)."""

    path: str
    layer: Any
    parent: Any
    compute: str
    params: str
    why: str
    composite: bool = False
    outputs: str | None = None
    kids: list[LayerPlan] = field(default_factory=list, repr=False)

    @property
    def keras_policy(self) -> keras.DTypePolicy:
        """The Keras dtype policy of this decision."""
        return keras_dtype_policy(self.params, self.compute)


def output_layers(model: Any) -> set[int]:
    """``id`` of the layers producing ``model``'s outputs (the last layer of a Sequential)."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
        return {id(layers[-1])} if layers else set()
    out = set()
    for tensor in getattr(model, "outputs", None) or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            out.add(id(history[0]))
    return out


def _op_subject(layer: Any) -> Any:
    """What the core classifies: the layer, or the activation's op for ``Activation`` layers."""
    if isinstance(layer, keras.layers.Activation):
        act = getattr(getattr(layer, "activation", None), "__name__", "")
        if act in _ACTIVATION_OPS:
            return _ACTIVATION_OPS[act]
    return layer


class _Planner:
    def __init__(self, policy: PrecisionPolicy, model: Any) -> None:
        self.policy, self.outputs = policy, output_layers(model)

    def intrinsic(self, layer: Any, path: str, forced: str | None) -> LayerPlan:
        """The decision before the parent is known; ``compute`` "" for a passthrough (follows its composite).
        ``forced``: the FP32 rule of an enclosing composite, if any."""
        policy, names = self.policy, class_names(layer)
        rule = policy.match_module_rule(names, path)
        graph, kids = is_graph(layer), children(layer)
        inner_forced = forced if rule is None else (f"module rule on {path!r}" if rule == "float32" else None)
        node = LayerPlan(path, layer, None, "", "", "", composite=bool(kids) and not graph)
        node.kids = [self.intrinsic(k, f"{path}.{k.name}" if path else k.name, inner_forced) for k in kids]
        if graph:
            return node
        if policy.compute == "float32":
            node.compute, node.why = "float32", "the recipe computes in float32"
        elif rule is None and forced is not None:
            node.compute, node.why = "float32", f"inside an FP32 layer ({forced})"
        elif node.composite:
            inner = {d.compute for d in _descendants(node) if d.compute}
            node.compute, node.why = policy.explain_composite(layer, path, inner)
        elif rule is None and id(layer) in self.outputs and policy.compute != policy.output:
            node.compute, node.why = policy.output, f"a model output: output={policy.output}"
        else:
            subject = layer if rule is not None else _op_subject(layer)
            node.compute, node.why = policy.explain(subject, path)
            if rule is None and policy.classify_op(policy.op_kind(subject)) == "passthrough":
                node.compute = ""
        return node

    def finish(self, node: LayerPlan, parent: LayerPlan | None, out: list[LayerPlan]) -> None:
        """Passthroughs follow their composite; storage dtypes; the casts at the boundaries."""
        policy = self.policy
        if not is_graph(node.layer):
            if not node.compute:
                node.compute = parent.compute if parent is not None else policy.compute
                if parent is not None:
                    node.why += f", follows {parent.path or 'the model'}"
            params = "float32" if node.compute == "float32" else policy.params
            node.params = node.compute if params not in ("float32", node.compute) else params
            node.parent = parent.layer if parent is not None else None
            node.outputs = boundary_cast(node.compute, parent.compute if parent is not None else None)
            if parent is None and node.composite and id(node.layer) in self.outputs:
                node.outputs = boundary_cast(node.compute, policy.output)
                if node.outputs:
                    node.why += f"; a model output: outputs cast to {policy.output}"
            elif node.outputs:
                node.why += f"; outputs cast to {node.outputs} for {parent.path or 'the model'}"
            out.append(node)
            parent = node
        for kid in node.kids:
            self.finish(kid, parent, out)


def _descendants(node: LayerPlan) -> list[LayerPlan]:
    return [d for k in node.kids for d in (k, *_descendants(k))]


def make_plan(model: Any, policy: PrecisionPolicy) -> list[LayerPlan]:
    """The decision for every layer below ``model`` (and ``model`` itself, path ``""``, when it is a
    subclassed model: it is a composite), in walk order; nested graph models get no row."""
    planner = _Planner(policy, model)
    root = planner.intrinsic(model, "", None)
    rows: list[LayerPlan] = []
    if is_graph(model):
        for kid in root.kids:
            planner.finish(kid, None, rows)
    else:
        planner.finish(root, None, rows)
    return rows
