"""N-gram prompt lookup: drafts copied from the request's own text, no weights (``draft``)."""
