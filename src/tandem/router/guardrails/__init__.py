"""Guardrails at the front door: input, output and policy layers the router enforces on every
request it serves, through either front door (`guard.Guardrails`; the docs' security page)."""

from tandem.router.guardrails.guard import Guardrails

__all__ = ["Guardrails"]
