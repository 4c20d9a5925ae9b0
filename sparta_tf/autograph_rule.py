"""AutoGraph leaves the library's code as it is written, as it leaves Keras's and TensorFlow's.

Inside a ``tf.function`` (Keras's ``train_function``, a user's own), AutoGraph rewrites every Python
function it reaches, module by module, unless a conversion rule exempts the module: TensorFlow exempts
``tensorflow``, ``keras``, ``numpy`` and others (``tensorflow/python/autograph/core/config.py``). The
library's functions need no rewriting (their loops and branches are over Python values; what runs per
step is ``tf.while_loop`` / ``tf.cond`` written out), and rewriting them is most of the cost of tracing
a DP step: about 40% of a small ``sparta-train`` run (measured: 58 s -> 35 s, ResNet-8 on 160 examples).

:func:`exempt_the_library` adds ``DoNotConvert("sparta_tf")`` to those rules, once per process, when
:mod:`sparta_tf.backend` is imported (before any traced code of the library can run). It changes only
whether ``sparta_tf.*`` is rewritten: AutoGraph's status is untouched, so a user's subclassed layers and
models that Keras converts (``Layer.__call__`` converts ``call`` while AutoGraph is enabled) are converted
as under ``keras.Model.fit``. A user function the library calls (a layer rule, a loss) runs as written.
The rules live in a private TensorFlow module; where it is missing, nothing changes but the speed.
"""

from __future__ import annotations

LIBRARY = "sparta_tf"


def exempt_the_library() -> bool:
    """Adds the rule (idempotent); True if AutoGraph now leaves ``sparta_tf.*`` unconverted."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # a TensorFlow without the private module: converted, as before
        return False
    rule = config.DoNotConvert(LIBRARY)
    if not any(isinstance(r, config.DoNotConvert) and str(r) == str(rule) for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)
    return True
