"""Trust: who a process is and whom it believes.

The CA and certificates (`pki`), TLS contexts built from PEM files with `ssl` alone
(`tlscontext`), the client of the controller's certificate signing endpoint and the keeper
that renews an identity at half-life (`enrollment`), and reloading credential files when
they change (`filewatch`). Every role uses this room; it imports no role.
"""
