"""Checks that stop a run loudly instead of letting it train wrong: every rank's config and replicas agree
(`rank_checks`), and a non-finite step ends the run (`divergence`)."""
