"""Private hyperparameter tuning (Papernot & Steinke 2022): a random number of private candidate runs,
the best released, the whole procedure within one (epsilon, delta).

* :mod:`~sparta_tf.tuning.space`: the search space and how a candidate draws from it;
* :mod:`~sparta_tf.tuning.procedure`: the secret draws, the noisy scores, the selection, the released
  ledger (shared by the library and ``sparta-tune``);
* :mod:`~sparta_tf.tuning.library`: :func:`tune_privately`;
* the privacy analysis: :mod:`sparta_tf.privacy.tuning`.
"""
