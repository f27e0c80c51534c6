"""Weight formats and their maths (docs/formats.md): the format types (:mod:`.weights`) and the
numpy reference of quantisation (:mod:`.quant`). Imports nothing else from colibrid."""
