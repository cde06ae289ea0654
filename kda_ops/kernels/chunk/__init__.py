"""Chunkwise KDA / Gated DeltaNet: the forward in two kernels, as FlashKDA splits it, and
its backward (``backward``).

1. ``prepare.py``: ``chunk_prepare_kernel``, token-parallel, solves each chunk on its own
   (gate, l2norm, beta sigmoid, the UT/WY solve) and stores w, u, qg, kd, Aqk and the
   chunk's total log-decay. The forward's chunks are ``FORWARD_CHUNK`` = 16 tokens, one
   row block each; the backward's are 64 (``reference.CHUNK_SIZE``), four row blocks.
2. ``recurrence.py``: ``chunk_recurrence_kernel``, head-parallel, walks the chunks with
   the state in registers and writes the outputs (and, when asked, the states at every
   64-token chunk start).

Why 16 in the forward: a 16-token chunk needs no coupling between row blocks, so a
prepare program holds one block and takes about half the registers of the 64-token one
(four programs an SM) and about half its time; the recurrence's four times as many steps
cost less than that saves (``benchmarks/results/forward_chunk16.json``; design notes in
``docs/design.md``). Long scans with few sequence-heads may take 64-token chunks instead
(``launch_chunk_kda``'s ``chunk``, chosen by ``planning.forward_chunk``): four times fewer
serial recurrence steps.

``launch.py`` launches the two (``launch_chunk_kda``), one after the other or, for long
sequences, in time windows that overlap one window's recurrence with the next one's
prepare (``pipeline.py``); ``planning.py`` picks the launches' flags and sizes;
``segments.py`` runs a long sequence's recurrence in segments;
``device.py`` holds the device functions the forward's and the backward's kernels share.

Both kernels order their parameters inputs → scalars → outputs and write every output
element the next kernel reads (``Aqk`` above the diagonal is masked on load, never
zero-filled), so they run as TensorRT AOT plugins (``lowering/tensorrt.py``).
"""

FORWARD_CHUNK = 16  # tokens of a forward prepare chunk and of a recurrence step
