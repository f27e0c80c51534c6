"""The SERVE line protocol between colibrid and its clients (shipped as colibri_protocol).

See SERVE.md beside this file; `codec` frames bytes, `messages` types them, `errors`
names the error codes, `home` locates the socket, `vectors` holds the conformance tests.
"""
