"""Lab effects: the lab repo, the ledger, the research notes, tracking and the report."""
