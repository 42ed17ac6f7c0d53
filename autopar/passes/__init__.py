"""Graph passes: strategy enumeration (``strategies``) and lowering of a plan (``lower``)."""
