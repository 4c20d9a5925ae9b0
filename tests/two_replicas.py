"""A two-replica ``MirroredStrategy`` on the two logical CPUs conftest sets up, for the tf.distribute tests."""

import pytest
import tensorflow as tf


def two_cpu_replicas() -> tf.distribute.MirroredStrategy:
    """Two replicas on the first two logical CPUs, or skip when the runtime started before conftest split the CPU.

    The all-reduce goes through ``ReductionToOneDevice``: TF 2.21's collective all-reduce fails the second
    ``MirroredStrategy`` a process builds ("Shape mismatch in the collective instance 100", plain Keras 3 ``fit``,
    nothing of ours), and xdist runs several of these tests in one worker. Reduce-then-broadcast sums the replicas'
    gradients as the collective does, which is what the tests compare against one replica.
    """
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs two logical CPU devices (set up in conftest before TF initialises)")
    return tf.distribute.MirroredStrategy([d.name for d in devices[:2]],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())
