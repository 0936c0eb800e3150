"""DFlash: block-diffusion draft layers, one forward per block of K drafts (``draft``), and its
checkpoint key map (``checkpoint``)."""
