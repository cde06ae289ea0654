"""Chunkwise KDA / Gated DeltaNet: the forward in two kernels, as FlashKDA splits it, and
its backward (``backward``).

1. ``prepare.py``: ``chunk_prepare_kernel``, token-parallel, solves each chunk of C = 64
   tokens on its own (gate, l2norm, beta sigmoid, the UT/WY solve) and stores w, u, qg,
   kd, Aqk and the chunk's total log-decay.
2. ``recurrence.py``: ``chunk_recurrence_kernel``, head-parallel, walks the chunks with
   the state in registers and writes the outputs (and, when asked, the chunk states).

``launch.py`` launches the two (``launch_chunk_kda``); ``planning.py`` picks the
launches' flags and sizes; ``segments.py`` runs a long sequence's recurrence in segments;
``device.py`` holds the device functions the forward's and the backward's kernels share.

Both kernels order their parameters inputs → scalars → outputs and write every output
element the next kernel reads (``Aqk`` above the diagonal is masked on load, never
zero-filled), so they run as TensorRT AOT plugins (``lowering/tensorrt.py``).
"""
