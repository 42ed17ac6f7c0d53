"""Test and demo helpers shipped with autopar (parity against single-device training)."""
