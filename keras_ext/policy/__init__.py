"""The recipe's op policy on a Keras model: each layer's dtype policy, the casts between regions, rebuilds,
the report, and ``compile`` under a recipe.

The core decides per layer (:class:`mp_callbacks.PrecisionPolicy`: module rules by class name through the base
classes or dotted path, then the op: softmax, norms, losses, embeddings and unknown layers FP32; matmuls,
convolutions and attention low precision; the layers producing the model's outputs at ``output=``); here:

* :func:`apply_policy` gives every layer the Keras dtype policy of that decision (:mod:`.plan`); a layer holding
  sublayers computes what they compute and the sublayers that compute otherwise hand their outputs back cast
  (:mod:`.casts`); an owner's sublayer policies are saved with it (:class:`PolicyMap`); a built model whose
  variables must change dtype is rebuilt (:mod:`.rebuild`: Keras cannot change a variable's dtype);
* :func:`policy_report` says what was decided per layer and why; :func:`low_precision_share` how much of the
  matmul work runs in low precision;
* :func:`guard_compile` (installed by :func:`apply_policy` and :func:`keras_ext.load_model`): ``model.compile``
  wraps an optimizer that cannot honour the recipe, or refuses one that lacks its masters.

The global recipe is Keras' own global dtype policy (:mod:`keras_ext.global_policy`).
"""

from .apply import apply_policy, layer_dtype_policies, owners
from .casts import cast_of, compute_dtype, install_casts, set_output_cast
from .guard import check_compiled, guard_compile, lacking, recipe_optimizer
from .maps import MODEL_OUTPUT, PolicyMap
from .plan import MATMUL_LAYERS, LayerPlan, make_plan, output_layers
from .rebuild import clone_with_policies, copy_weights, has_own_constructor, is_clonable, rebuilt
from .report import low_precision_share, matmul_layers, policy_report

__all__ = [
    "MATMUL_LAYERS",
    "MODEL_OUTPUT",
    "LayerPlan",
    "PolicyMap",
    "apply_policy",
    "cast_of",
    "check_compiled",
    "clone_with_policies",
    "compute_dtype",
    "copy_weights",
    "guard_compile",
    "has_own_constructor",
    "install_casts",
    "is_clonable",
    "lacking",
    "layer_dtype_policies",
    "low_precision_share",
    "make_plan",
    "matmul_layers",
    "output_layers",
    "owners",
    "policy_report",
    "rebuilt",
    "recipe_optimizer",
    "set_output_cast",
]
