"""Model families, each built from pagedserve ops and torch linear layers only."""
