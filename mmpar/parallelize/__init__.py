"""Techniques that change how a model is laid out over ranks.

:func:`mmpar.parallelize.compose.parallelize` applies them in one fixed
order (tensor parallel, pipeline split, activation checkpointing / compile,
the data-parallel wrapper); each technique lives in its own module here.
"""
