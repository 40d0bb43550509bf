"""Helpers shared by every op: input checks, state dtype, log-sum-exp merging."""
