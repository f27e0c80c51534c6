"""Weight formats and their maths (DESIGN §5): the format types (:mod:`.weights`) and the
numpy reference of quantisation (:mod:`.quant`). Imports nothing else from colibrid."""
