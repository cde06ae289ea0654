"""Depthwise causal conv1d: the prefill (``forward.py``), its backward (``backward.py``)
and the decode step (``step.py``), which share the device functions of ``device.py``.

Layouts: x ``[B, T, D]`` (or packed ``[1, T_total, D]`` with ``cu_seqlens``); weight
``[D, W]``; state ``[N, D, W - 1]``, entry ``j`` holding the input ``W - 1 - j`` tokens
before the sequence (or before the end, for the final state). With ``state_indices`` the
state is a pool and sequence n uses slot ``state_indices[n]`` (negative: padding, no
history and no write).
"""
