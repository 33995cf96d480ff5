"""Polynomials in wire sizes and block sizes, for the symbolic side of a report.

The cost model says what a schedule moves as a formula (``2*b*h*d*q*x/g_q``)
as well as a number.  The formulas it needs are sums of monomials with
rational coefficients and integer (possibly negative) exponents: sizes
multiply, block sizes divide.  A dozen lines of dict arithmetic cover that,
so napkin does not depend on a computer algebra system.

Symbols: a wire's name stands for its size (``q``); ``g_q`` is the block a
level groups q by, ``s_x`` the block x is streamed by, ``c_x`` the chunk of
x each program streams (napkin/cost/chunks.py), ``P_q`` the number of
devices q is split across, ``M`` a capacity in elements.  Printing is
deterministic: terms by descending degree, then alphabetically.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Union

Number = Union[int, Fraction]
Monomial = tuple[tuple[str, int], ...]  # sorted (symbol, exponent), exponents != 0


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    powers = dict(a)
    for sym, exp in b:
        powers[sym] = powers.get(sym, 0) + exp
    return tuple(sorted((s, e) for s, e in powers.items() if e != 0))


@dataclass(frozen=True)
class Poly:
    """An immutable sum of ``coefficient * monomial`` terms."""

    terms: tuple[tuple[Monomial, Fraction], ...] = ()

    # -- construction --------------------------------------------------------
    @staticmethod
    def const(value: Number) -> "Poly":
        return Poly._from({(): Fraction(value)})

    @staticmethod
    def sym(name: str, exponent: int = 1) -> "Poly":
        return Poly._from({((name, exponent),): Fraction(1)})

    @staticmethod
    def _from(d: Mapping[Monomial, Fraction]) -> "Poly":
        return Poly(tuple(sorted((m, c) for m, c in d.items() if c != 0)))

    # -- arithmetic ----------------------------------------------------------
    def __add__(self, other: Union["Poly", Number]) -> "Poly":
        other = other if isinstance(other, Poly) else Poly.const(other)
        out = dict(self.terms)
        for m, c in other.terms:
            out[m] = out.get(m, Fraction(0)) + c
        return Poly._from(out)

    __radd__ = __add__

    def __neg__(self) -> "Poly":
        return self * -1

    def __sub__(self, other: Union["Poly", Number]) -> "Poly":
        return self + (-(other if isinstance(other, Poly) else Poly.const(other)))

    def __mul__(self, other: Union["Poly", Number]) -> "Poly":
        other = other if isinstance(other, Poly) else Poly.const(other)
        out: dict[Monomial, Fraction] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = _mono_mul(m1, m2)
                out[m] = out.get(m, Fraction(0)) + c1 * c2
        return Poly._from(out)

    __rmul__ = __mul__

    def __truediv__(self, other: Union["Poly", Number]) -> "Poly":
        """Division by a constant or a single monomial (all this model needs)."""
        if not isinstance(other, Poly):
            return self * Poly.const(Fraction(1) / Fraction(other))
        if len(other.terms) != 1:
            raise ValueError("can only divide a polynomial by a monomial")
        (m, c), = other.terms
        return self * Poly._from({tuple((s, -e) for s, e in m): 1 / c})

    def is_zero(self) -> bool:
        return not self.terms

    def symbols(self) -> set[str]:
        return {s for m, _ in self.terms for s, _ in m}

    # -- evaluation and printing ---------------------------------------------
    def evaluate(self, env: Mapping[str, Number]) -> Fraction:
        """The exact value; raises KeyError naming a symbol ``env`` lacks."""
        total = Fraction(0)
        for m, c in self.terms:
            value = c
            for sym, exp in m:
                value *= Fraction(env[sym]) ** exp
            total += value
        return total

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        ordered = sorted(self.terms, key=lambda t: (-sum(max(e, 0) for _, e in t[0]), t[1] < 0,
                                                      _mono_str(t[0], Fraction(1))))
        out = ""
        for i, (m, c) in enumerate(ordered):
            text = _mono_str(m, abs(c))
            if i == 0:
                out = ("-" if c < 0 else "") + text
            else:
                out += (" - " if c < 0 else " + ") + text
        return out


def _mono_str(m: Monomial, coeff: Fraction) -> str:
    """``2*b*h*q*x/g_q``; a fractional coefficient puts its denominator below."""
    num = [s if e == 1 else f"{s}^{e}" for s, e in m if e > 0]
    den = [s if e == -1 else f"{s}^{-e}" for s, e in m if e < 0]
    if coeff.numerator != 1 or not num:
        num.insert(0, str(coeff.numerator))
    if coeff.denominator != 1:
        den.insert(0, str(coeff.denominator))
    text = "*".join(num)
    if den:
        text += "/" + (den[0] if len(den) == 1 else "(" + "*".join(den) + ")")
    return text
