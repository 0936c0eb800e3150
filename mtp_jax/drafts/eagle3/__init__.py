"""EAGLE-3: one layer over three fused target layers, GQA or MLA (``draft``), and its three
published key layouts (``checkpoint``)."""
