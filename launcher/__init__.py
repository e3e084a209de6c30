"""The `pdserve` command line and `pdserve up`: the top layer, which may import every other."""
