"""kvserve's command line (and, with the server work, the HTTP front)."""
