"""What a saved model needs keras_ext for: the dtype policies of nested layers (:class:`PolicyMap`).

Keras saves one dtype policy per layer config; a layer that builds its sublayers itself (keras_hub's
``TransformerDecoder``, ``MultiHeadAttention``, a keras_hub backbone) hands them its own policy, so
their policies are lost on a round trip (LayerNorms came back ``mixed_bfloat16``).  Such a layer
(an *owner*) holds a :class:`PolicyMap`: Keras' ``DTypePolicyMap`` (its sublayers created from it
find their entry by ``layer.path`` and get the saved variable dtypes) that also lists every sublayer
in walk order, those without a path (``Softmax``, ``Dropout``) included, and the cast of the owner's
outputs.  It is live: saved, it reports the owner's current policies (a fallback's moves included).

It is registered (``keras_ext>PolicyMap``) and loads only through :func:`keras_ext.load_model` (or keras_ext's
own clones: :func:`keras_ext.layers.loading_scope`), which also installs what Keras cannot rebuild: the casts
at region boundaries.  Keras' ``load_model`` of such a file raises an error that names it instead of failing
later (the residual add of mixed dtypes).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import keras

from mp_callbacks.policy import PolicyError

from ..layers import HOW_TO_LOAD, loading_permitted, resolved_policy, walk

__all__ = ["MODEL_OUTPUT", "PolicyMap"]

MODEL_OUTPUT = "_mp_model_output_dtype"
"""Attribute of a composite producing a model output: the dtype its outputs are cast to (``output=``)."""


@keras.saving.register_keras_serializable(package="keras_ext")
class PolicyMap(keras.dtype_policies.DTypePolicyMap):
    """The dtype policies of an owner's sublayers (see the module docstring).

    ``layers``: ``[dotted path relative to the owner, class name, policy, model-output cast]`` per sublayer
    in walk order; ``outputs``: the :data:`MODEL_OUTPUT` cast of the owner itself (None: none).
    """

    def __init__(self, default_policy: Any = None, policy_map: dict[str, Any] | None = None,
                 layers: list[Any] | None = None, outputs: str | None = None) -> None:
        super().__init__(default_policy, policy_map)
        self.layers = [(p, c, keras.dtype_policies.get(kp), out) for p, c, kp, out in (layers or [])]
        self.outputs = outputs
        self._owner: Any = None
        self._own: Any = None  # the owner's own policy, once bound and refreshed

    @classmethod
    def of(cls, owner: Any) -> PolicyMap:
        """A map holding the current policies of ``owner``'s sublayers, bound to it (not installed)."""
        made = cls(resolved_policy(owner))
        made.bind(owner)
        made.refresh()
        return made

    def bind(self, owner: Any) -> None:
        """Report ``owner``'s current policies from now on."""
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> Any:
        """The layer whose sublayers' policies this map reports (None: not bound)."""
        return self._owner() if self._owner is not None else None

    @property
    def default_policy(self) -> Any:
        """The owner's own policy (before a refresh: the one given)."""
        return self._own if self._own is not None else super().default_policy

    def refresh(self) -> None:
        """Take the bound owner's current policies (its own, its sublayers', the output casts)."""
        owner = self.owner
        if owner is None:
            return
        entries = {layer.path: resolved_policy(layer) for _, layer in walk(owner) if layer.path}
        rows = [(p, type(layer).__name__, resolved_policy(layer), layer.__dict__.get(MODEL_OUTPUT))
                for p, layer in walk(owner)]
        own = _plain(owner)
        for key in list(self):
            del self[key]
        for key, policy in entries.items():
            self[key] = policy
        self._own, self.layers, self.outputs = own, rows, owner.__dict__.get(MODEL_OUTPUT)

    def get_config(self) -> dict[str, Any]:
        self.refresh()
        ser = keras.dtype_policies.serialize
        return {"default_policy": ser(self.default_policy), "policy_map": {k: ser(self[k]) for k in self},
                "layers": [[p, c, ser(kp), out] for p, c, kp, out in self.layers], "outputs": self.outputs}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], custom_objects: Any = None) -> PolicyMap:
        if not loading_permitted():
            raise PolicyError(f"this model holds layers whose sublayers compute in other dtypes: {HOW_TO_LOAD}")
        get = keras.dtype_policies.get
        return cls(get(config["default_policy"]), {k: get(v) for k, v in config["policy_map"].items()},
                   config.get("layers", []), config.get("outputs"))


def _plain(owner: Any) -> Any:
    """The owner's own policy (its entry in the map it holds, else the map's default)."""
    policy = owner.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[owner.path] if owner.path and owner.path in policy else policy.default_policy
    return policy
