"""The tiny sparta-train config the CLI tests run, and edits to config dicts: set (or delete) one dotted key."""


class _Delete:
    """Marks a key to remove; its repr is stable, so the test ids are the same in every process
    (pytest-xdist's workers must collect identical ids)."""

    def __repr__(self) -> str:
        return "<deleted>"


DELETE = _Delete()


def set_key(config: dict, dotted: str, value) -> dict:
    """``config`` with ``config[a][b][c] = value`` for ``dotted = "a.b.c"`` (missing sections made
    empty; :data:`DELETE` removes the key), changed in place and returned."""
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return config


def tiny_config(output_dir, method="sparta", epochs=3, export=False, **training) -> dict:
    """``method`` for ``epochs`` epochs on 160 synthetic 3-class images (10% validation, 20% test),
    ResNet-8-GN, epsilon 8 at delta 1e-3, batch 32, seed 0; ``training`` adds or replaces training keys.
    ``export``: the TF Serving export (the CLI's default, on) takes about half of such a run (9 of 17 s,
    measured), so it is off unless the test is about what a run exports."""
    return {
        "data": {"source": "synthetic", "num_examples": 160, "num_classes": 3, "val_fraction": 0.1,
                 "test_fraction": 0.2},
        # ResNet-8-GN: the same layer kinds as ResNet-20-GN; a third of the layers to trace (2-3x faster runs)
        "model": {"name": "cifar_resnet_gn", "depth": 8},
        "method": {"name": method, "density": 0.25},
        "privacy": {"target_epsilon": 8.0, "delta": 1e-3},
        "training": {"epochs": epochs, "batch_size": 32, "learning_rate": 0.05, "seed": 0, **training},
        "export": {"enabled": export},
        "output_dir": str(output_dir),
    }


ONE_METHOD_OF_EACH_KIND = ("all", "dp_frost", "dp_ssgd", "mp", "oracle", "sparta", "x_bitfit")
"""The methods the costlier per-method integration tests run (sparta-train end to end, augmentation
multiplicity): one of each method class (a role set, two phases, a budget split before training, pruning
before training, a static mask, a selection epoch) and the non-private oracle. Every method of
``sparta_tf.methods.METHODS`` trains through ``make_private`` (``tests/test_make_private.py``);
``tests/test_method_registry.py`` checks that this tuple keeps one method of every class."""
