"""Who owns each key namespace: the check every request that names keys passes first.

Every key carries its namespace's 8-byte id (``quotas.tenant_of``). A namespace belongs to

- the uids that ``namespace_owners`` names for it, when the configuration names it (no claim
  is read or made for it);
- else the uid whose session first named it in a request that asks the cards about objects
  (EXIST, GET, PUT, DELETE): that request claims it first, on every card in service
  (``Card.claim_namespace``: atomic, never replaced), so the owner survives restarts of the
  gateway and is the same for every gateway sharing the card.

A request of a session whose uid does not own every namespace its keys name is refused whole
(FORBIDDEN) before any card is asked about an object: it learns nothing of the namespace's
objects, not even whether one is there, and changes nothing (it claims nothing either: a
request's namespaces are claimed only once none of them is another's). Root and the gateway's
own user are no exception. Cards that disagree about an owner make the namespace nobody's:
FORBIDDEN for everyone (logged) until ``namespace_owners`` names its owners. UNLOCK is checked
the same way but claims nothing (it asks no card; a namespace nobody claimed holds no pin).

``NamespaceOwners``, one per gateway:

- ``verdict(uid, request, settled)`` on the loop, from memory, in one call: None when ``uid``
  may use every namespace the request's keys name (it goes on); ``Unresolved`` when the owners
  of some must be looked up first; FORBIDDEN (``ProtocolError``) when one is another's, which
  refuses the request whole;
- ``resolve(unresolved)`` on the I/O pool: what the cards in service record for each of its
  namespaces (and, when it claims and none of them is another's, the claims of its uid on the
  unclaimed ones); CardIOError when no card answers;
- ``learn(found)`` on the loop: owners (and conflicts) are cached for the gateway's life (a
  claim is never undone, so a cached owner never goes stale);
- ``keep_claims()`` on the pool, every few seconds: the cards keep their records from eviction.
"""

from __future__ import annotations

import logging
from typing import Collection, Mapping, NamedTuple, Optional, Sequence, Union

from adpkv_core.wire import protocol as P

from adpkv_gateway.cards.base import Card, CardError, CardIOError
from adpkv_gateway.cards.quotas import NS_ID, tenant_id
from adpkv_gateway.store.service import CardService

logger = logging.getLogger("adpkv.gateway")

MAX_NAMESPACES_PER_REQUEST = 16    # an engine names one or two; more is refused (each new one costs a claim)
CONFLICT = -1                      # the cards record different owners: the namespace is nobody's
KEEP_CLAIMS_S = 5.0                # how often the cards' claim records are touched (keep_claims)

Found = dict[bytes, Optional[int]]     # namespace id -> owner uid, CONFLICT, or None (nobody's yet)
# the requests that name keys (MAP claims as GET does; UNLOCK claims nothing)
Keyed = Union[P.Exist, P.Unlock, P.Delete, P.Get, P.Put, P.MapRequest]


class Unresolved(NamedTuple):
    """``NamespaceOwners.verdict``'s answer for a request that must wait: the namespaces
    (``nsids``) whose owners the cards are asked first (``resolve``), for the session's ``uid``,
    which claims the unclaimed ones (``claim``; not for UNLOCK)."""

    nsids: list[bytes]
    uid: int
    claim: bool


class NamespaceOwners:
    """The owners of the key namespaces this gateway has seen (see the module's contract).
    ``cards``: the gateway's cards; ``service``: which of them are in service now (the records
    are read and claims made on those, in a fixed order: by serial)."""

    def __init__(self, configured: Mapping[str, Sequence[int]], cards: Sequence[Card], service: CardService):
        self.configured: dict[bytes, frozenset[int]] = {tenant_id(name): frozenset(uids)
                                                        for name, uids in configured.items()}
        self.claims: dict[bytes, int] = {}       # namespace id -> owner uid or CONFLICT (loop only)
        self._all_cards = cards
        self._service = service
        self._refused: set[tuple[int, bytes]] = set()   # (uid, namespace) refused once: logged once

    # ------------------------------------------------------------------ the loop
    def verdict(self, uid: int, request: Keyed, settled: Optional[Found] = None) -> Optional[Unresolved]:
        """Whether the session of user ``uid`` may go on with ``request`` (see the module's
        contract): None, ``Unresolved``, or FORBIDDEN raised. ``settled``: what ``resolve`` just
        found for this request (a namespace it left nobody's is usable without a claim:
        UNLOCK's). BAD_MESSAGE for a request naming more than ``MAX_NAMESPACES_PER_REQUEST``
        namespaces."""
        nsids = {key[NS_ID] for key in request.keys}
        if len(nsids) > MAX_NAMESPACES_PER_REQUEST:
            raise P.ProtocolError(P.BAD_MESSAGE, f"a request names at most {MAX_NAMESPACES_PER_REQUEST} key "
                                  f"namespaces, this one {len(nsids)}")
        unknown = []
        for ns in nsids:
            owners: Optional[Collection[int]] = self.configured.get(ns)
            if owners is None:
                owner = self.claims.get(ns)
                if owner is None:
                    if settled is not None and ns in settled and settled[ns] is None:
                        continue
                    unknown.append(ns)
                    continue
                owners = (owner,)
            if uid not in owners:
                if (uid, ns) not in self._refused and len(self._refused) < 4096:
                    self._refused.add((uid, ns))
                    logger.warning("uid %d named keys of namespace id:%s, %s: refused (FORBIDDEN)", uid, ns.hex(),
                                   "whose cards record different owners" if owners == (CONFLICT,)
                                   else "which belongs to another user")
                raise P.ProtocolError(P.FORBIDDEN, f"{request.op} names keys of namespace id:{ns.hex()}, which "
                                      "belongs to another user; nothing was done")
        return Unresolved(unknown, uid, not isinstance(request, P.Unlock)) if unknown else None

    def learn(self, found: Found) -> None:
        for ns, owner in found.items():
            if owner is not None:
                self.claims[ns] = owner

    # ------------------------------------------------------------------ the pool
    def _cards(self) -> list[Card]:
        """The cards in service now, by serial (claims are made in this order)."""
        return sorted((c for c, on in zip(self._all_cards, self._service.active) if on and c.serial),
                      key=lambda c: c.serial)

    def resolve(self, unresolved: Unresolved) -> Found:
        """What the cards in service record for each of its namespaces; when it claims, and
        none of them is another's, its uid claims the ones nobody has claimed."""
        cards = self._cards()
        if not cards:
            raise CardIOError("no card is in service: the owners of key namespaces cannot be read")
        uid = unresolved.uid
        found: Found = {ns: self._lookup(cards, ns) for ns in unresolved.nsids}
        if unresolved.claim and all(owner in (None, uid) for owner in found.values()):
            for ns, owner in found.items():
                if owner is None:
                    found[ns] = self._claim(cards, ns, uid)
        return found

    def _lookup(self, cards: list[Card], ns: bytes) -> Optional[int]:
        """The owner the cards record (a card that records none while another does gets that
        record too: a card out of service at the claim learns it here); CONFLICT when they
        disagree or a record is damaged."""
        owners: dict[int, list[Card]] = {}
        lacking: list[Card] = []
        answered = False
        for card in cards:
            try:
                owner = card.namespace_owner(ns)
            except CardIOError as exc:
                logger.warning("%s", exc)
                continue
            except CardError as exc:
                logger.error("%s: the namespace is refused to everyone until namespace_owners names it", exc)
                owner = CONFLICT
            answered = True
            if owner is None:
                lacking.append(card)
            else:
                owners.setdefault(owner, []).append(card)
        if not answered:
            raise CardIOError(f"no card answered who owns key namespace id:{ns.hex()}")
        if len(owners) > 1 or CONFLICT in owners:
            self._conflict(ns, owners)
            return CONFLICT
        if not owners:
            return None
        (owner,) = owners
        for card in lacking:
            self._record(card, ns, owner)
        return owner

    def _claim(self, cards: list[Card], ns: bytes, uid: int) -> int:
        """``uid``'s claim on every card, in order: the first card's owner stands (two gateways
        claiming at once agree on it); a card recording another owner is a conflict."""
        owners: dict[int, list[Card]] = {}
        for card in cards:
            owner = self._record(card, ns, uid if not owners else next(iter(owners)))
            if owner is not None:
                owners.setdefault(owner, []).append(card)
        if not owners:
            raise CardIOError(f"no card recorded the claim of key namespace id:{ns.hex()}")
        if len(owners) > 1:
            self._conflict(ns, owners)
            return CONFLICT
        (owner,) = owners
        if owner == uid:
            logger.info("Key namespace id:%s now belongs to uid %d (claimed on %d card(s))", ns.hex(), uid,
                        len(owners[owner]))
        return owner

    @staticmethod
    def _record(card: Card, ns: bytes, uid: int) -> Optional[int]:
        """``card.claim_namespace``: the owner it records now (CONFLICT for a damaged record),
        None when it does not answer."""
        try:
            return card.claim_namespace(ns, uid)
        except CardIOError as exc:
            logger.warning("%s", exc)
            return None
        except CardError as exc:
            logger.error("%s", exc)
            return CONFLICT

    @staticmethod
    def _conflict(ns: bytes, owners: Mapping[int, list[Card]]) -> None:
        logger.error("The cards record different owners of key namespace id:%s (%s): it is refused to everyone; "
                     "name its owners in namespace_owners", ns.hex(),
                     "; ".join(f"{'a damaged record' if uid == CONFLICT else f'uid {uid}'} on "
                               f"{', '.join(c.serial or c.device for c in cards)}" for uid, cards in owners.items()))

    def keep_claims(self) -> None:
        for card in self._cards():
            try:
                card.keep_claims()
            except (CardIOError, CardError) as exc:
                logger.debug("%s", exc)
