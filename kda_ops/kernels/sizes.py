"""Block sizes and grid extents the launchers compute on the host.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions, callable from
kernels too, and each host call pays for unwrapping its arguments as constexprs (~2 µs
on the CI machine, against ~0.05 µs for the integer arithmetic); a prefill of the
hybrid model made ~90 such calls from our launchers. These are the same arithmetic for
host ints.
"""


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for positive ints."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()
