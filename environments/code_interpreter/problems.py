"""Computation problems that are easy to program and hard to do in one's head, with answers from the generator.

    rows = generate_problems("test", 20, seed=0)
    row = {"id": "code-test-0-0", "question": "What is the sum of all prime numbers below 12345?",
           "answer": "8427604", "family": "prime_sum", "params": {"n": 12345}}

Eight families (`FAMILIES`): sums and counts of primes, counts of multiples, Fibonacci numbers modulo M, digit
sums of powers and factorials, Collatz step counts and divisor sums; parameters are drawn from a seeded random
generator. Every answer is an integer computed here, and `reference_program(row)` is an independent Python
program that prints it (what the oracle runs through the `code_interpreter` tool).

Splits are disjoint by construction: a problem's split is a hash of its family and parameters (10% "test",
10% "dev", the rest "train"), so no problem can appear in two splits, whatever seeds they were drawn with.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

SPLITS = ("train", "dev", "test")

# Upper bound on the integers the prime families use (sieved once per process).
_PRIME_LIMIT = 1_000_000


@functools.lru_cache(maxsize=1)
def _primes() -> list[int]:
    sieve = bytearray([1]) * (_PRIME_LIMIT + 1)
    sieve[0] = sieve[1] = 0
    for i in range(2, math.isqrt(_PRIME_LIMIT) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, _PRIME_LIMIT + 1, i)))
    return [i for i, is_prime in enumerate(sieve) if is_prime]


def _fibonacci_mod(n: int, m: int) -> int:
    """F(n) mod m by fast doubling (F(1) = F(2) = 1)."""

    def pair(k: int) -> tuple[int, int]:  # (F(k), F(k + 1)) mod m
        if k == 0:
            return 0, 1 % m
        a, b = pair(k // 2)
        c = a * ((2 * b - a) % m) % m
        d = (a * a + b * b) % m
        return (d, (c + d) % m) if k % 2 else (c, d)

    return pair(n)[0]


def _divisor_sum(n: int) -> int:
    """sigma(n) from n's prime factorisation (product of (p^(e+1) - 1) / (p - 1))."""
    total, rest = 1, n
    for p in _primes():
        if p * p > rest:
            break
        if rest % p == 0:
            power = 1
            while rest % p == 0:
                rest //= p
                power *= p
            total *= (power * p - 1) // (p - 1)
    if rest > 1:
        total *= rest + 1
    return total


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


# Each family: (draw parameters, question text, answer, reference program). The reference programs are written
# independently of the answer functions (plain loops and sieves where the generator uses formulas), so the
# oracle reaching reward 1.0 checks one against the other.
Family = tuple[Callable[[random.Random], dict], Callable[..., str], Callable[..., int], Callable[..., str]]


def _prime_sum() -> Family:
    def draw(rng):
        return {"n": rng.randint(1_000, 300_000)}

    def answer(n):
        primes = _primes()
        return sum(primes[: bisect.bisect_left(primes, n)])

    def program(n):
        return (f"n = {n}\nis_prime = [True] * n\nis_prime[0] = is_prime[1] = False\n"
                "for i in range(2, int(n ** 0.5) + 1):\n    if is_prime[i]:\n"
                "        for j in range(i * i, n, i):\n            is_prime[j] = False\n"
                "print(sum(i for i in range(n) if is_prime[i]))")

    return draw, lambda n: f"What is the sum of all prime numbers below {n}?", answer, program


def _prime_count() -> Family:
    def draw(rng):
        a = rng.randint(1, 500_000)
        return {"a": a, "b": a + rng.randint(1_000, 499_999)}

    def answer(a, b):
        primes = _primes()
        return bisect.bisect_right(primes, b) - bisect.bisect_left(primes, a)

    def program(a, b):
        return (f"a, b = {a}, {b}\nis_prime = [True] * (b + 1)\nis_prime[0] = is_prime[1] = False\n"
                "for i in range(2, int(b ** 0.5) + 1):\n    if is_prime[i]:\n"
                "        for j in range(i * i, b + 1, i):\n            is_prime[j] = False\n"
                "print(sum(1 for i in range(a, b + 1) if is_prime[i]))")

    return draw, lambda a, b: f"How many prime numbers are there between {a} and {b}, inclusive?", answer, program


def _multiples_count() -> Family:
    def draw(rng):
        a = rng.randint(1, 1_000_000)
        k, m = rng.sample(range(2, 98), 2)
        return {"a": a, "b": a + rng.randint(1_000, 2_000_000), "k": k, "m": m}

    def answer(a, b, k, m):
        lcm = k * m // math.gcd(k, m)

        def upto(x):
            return x // k + x // m - x // lcm

        return upto(b) - upto(a - 1)

    def program(a, b, k, m):
        return f"print(sum(1 for n in range({a}, {b} + 1) if n % {k} == 0 or n % {m} == 0))"

    def question(a, b, k, m):
        return f"How many integers n with {a} <= n <= {b} are divisible by {k} or by {m} (or both)?"

    return draw, question, answer, program


def _fibonacci() -> Family:
    def draw(rng):
        return {"n": rng.randint(1_000, 500_000), "m": rng.randint(1_000, 1_000_000_007)}

    def program(n, m):
        return f"a, b = 1, 1\nfor _ in range({n} - 2):\n    a, b = b, (a + b) % {m}\nprint(b % {m})"

    def question(n, m):
        return f"Let F(1) = F(2) = 1 and F(k) = F(k - 1) + F(k - 2). What is F({n}) modulo {m}?"

    return draw, question, _fibonacci_mod, program


def _power_digit_sum() -> Family:
    # 99 ** 2000 has 3,992 digits: below Python's 4,300-digit limit on int -> str conversion.
    def draw(rng):
        return {"a": rng.randint(2, 99), "b": rng.randint(100, 2_000)}

    def answer(a, b):
        return sum(int(digit) for digit in str(a**b))

    def program(a, b):
        return f"x = {a} ** {b}\ntotal = 0\nwhile x:\n    x, digit = divmod(x, 10)\n    total += digit\nprint(total)"

    return draw, lambda a, b: f"What is the sum of the decimal digits of {a}^{b}?", answer, program


def _factorial_digit_sum() -> Family:
    # 1500! has 4,115 digits: below the int -> str limit too.
    def draw(rng):
        return {"n": rng.randint(50, 1_500)}

    def answer(n):
        return sum(int(digit) for digit in str(math.prod(range(1, n + 1))))

    def program(n):
        return f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))"

    return draw, lambda n: f"What is the sum of the decimal digits of {n}! ({n} factorial)?", answer, program


def _collatz() -> Family:
    def draw(rng):
        return {"n": rng.randint(1_000, 10_000_000)}

    def program(n):
        return f"n, steps = {n}, 0\nwhile n != 1:\n    n = 3 * n + 1 if n % 2 else n // 2\n    steps += 1\nprint(steps)"

    def question(n):
        return (f"Start from {n} and repeatedly replace the number n by n / 2 if n is even, or by 3n + 1 if n is "
                "odd. How many replacements does it take to reach 1?")

    return draw, question, _collatz_steps, program


def _divisor_sum_family() -> Family:
    def draw(rng):
        return {"n": rng.randint(10_000, 100_000_000)}

    def program(n):
        return (f"n, total, d = {n}, 0, 1\nwhile d * d <= n:\n    if n % d == 0:\n        total += d\n"
                "        if d != n // d:\n            total += n // d\n    d += 1\nprint(total)")

    def question(n):
        return f"What is the sum of all positive divisors of {n}, including 1 and {n} itself?"

    return draw, question, _divisor_sum, program


FAMILIES: dict[str, Family] = {
    "prime_sum": _prime_sum(),
    "prime_count": _prime_count(),
    "multiples_count": _multiples_count(),
    "fibonacci_mod": _fibonacci(),
    "power_digit_sum": _power_digit_sum(),
    "factorial_digit_sum": _factorial_digit_sum(),
    "collatz_steps": _collatz(),
    "divisor_sum": _divisor_sum_family(),
}


def split_of(family: str, params: dict) -> str:
    """The split a problem belongs to, from a hash of its family and parameters (10% test, 10% dev)."""
    key = family + ":" + ",".join(f"{k}={params[k]}" for k in sorted(params))
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def check_families(families: Sequence[str]) -> list[str]:
    """The family names, checked against FAMILIES (empty: all of them)."""
    names = list(families) or list(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown code_interpreter problem families {unknown}; known: {', '.join(FAMILIES)}")
    return names


def generate_problems(split: str, num: int, seed: int, families: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`num` distinct problems of `split`, the families taken in turn; deterministic in (split, seed, families),
    and the first k of `num` rows are the rows of `num=k`."""
    if split not in SPLITS:
        raise ValueError(f"unknown code_interpreter split {split!r}; expected one of {SPLITS}")
    names = check_families(families)
    rng = random.Random(f"code_interpreter/{split}/{seed}")
    rows, seen = [], set()
    for index in range(num):
        name = names[index % len(names)]
        draw, question, answer, _ = FAMILIES[name]
        for _ in range(10_000):  # about 1 draw in 10 lands in a held-out split: never near this bound
            params = draw(rng)
            key = (name, tuple(sorted(params.items())))
            if key not in seen and split_of(name, params) == split:
                break
        else:
            raise RuntimeError(f"could not draw a new {split} problem of family {name!r} in 10,000 tries; "
                               "ask for fewer problems")
        seen.add(key)
        rows.append({"id": f"code-{split}-{seed}-{index}", "question": question(**params),
                     "answer": str(answer(**params)), "family": name, "params": params})
    return rows


def reference_program(row: dict[str, Any]) -> str:
    """A Python program that prints the row's answer (written independently of the generator's answer)."""
    return FAMILIES[row["family"]][3](**row["params"])
