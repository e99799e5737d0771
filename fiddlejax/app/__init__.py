"""The ``fiddlejax train`` job: the application built on the library.

The only part of ``fiddlejax`` that imports the example ``models`` (through ``models.REGISTRY``):
``build`` turns a config into a model, its data, a :class:`~fiddlejax.plan.Plan` and an optimizer;
``train`` runs the loop; ``logs`` writes metrics; ``checkpoints`` holds the ``checkpoint:`` and
``resume`` glue around :class:`~fiddlejax.checkpoint.CheckpointManager`; ``export`` writes a Llama
run as a Hugging Face directory.
"""
