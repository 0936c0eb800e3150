"""DSpark: DFlash's one-pass block draft with a sequential head (Markov, gated or RNN) sampled
left to right inside the block and a confidence head (``draft``), DeepSpec's checkpoint layout
(``checkpoint``)."""
