"""Inference engines as receivers: an engine follows the hub like any raysync subscriber.

:mod:`raysync.engines.vllm` makes a vLLM engine a :class:`~raysync.receivers.target.Target`
(:class:`~raysync.engines.vllm.VLLMEngine`, :func:`~raysync.engines.vllm.follow_engine`);
:mod:`raysync.engines.vllm_async` does the same for vLLM's ``AsyncLLM``,
:mod:`raysync.engines.vllm_scheme` offers torchrl's ``VLLMWeightSyncScheme`` on it, and
:mod:`raysync.engines.vllm_transfer` is the vLLM side of it, the weight-transfer engine
named ``raysync`` that vLLM's own update path calls. Neither is imported by ``import
raysync``: vLLM is an optional dependency (``pip install raysync[vllm]``).

Example:
    >>> from raysync.engines.vllm import follow_engine  # doctest: +SKIP
    >>> engine = follow_engine(llm, "policy")            # doctest: +SKIP
"""
