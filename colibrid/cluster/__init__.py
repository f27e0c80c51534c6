"""Beyond one machine: llama.cpp's RPC binaries built from the pinned sources, and
`colibri plan` (measurements, decode ceilings, the launch lines of a cluster)."""
