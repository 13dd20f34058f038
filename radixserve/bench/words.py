"""A fixed vocabulary for synthetic prompts: common English words, mostly one BPE token each.

Prompt text is drawn from this list with a seeded `random.Random`, so a scenario's prompts are
the same on every machine and need no downloads. Keep the list stable: changing it changes every
benchmark prompt (and so every comparison with older results).
"""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy music market sense nation plan college interest death
    experience effect use class control care field development role effort rate heart drug
    show leader light voice wife police mind price report decision son view relationship town
    road arm difference value building action model season society tax director position
    player record paper space ground form event official matter center couple site project
    activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair
    window evidence population truth song energy unit island river garden winter summer spring
    stone glass bread apple horse bird fish dog cat ship train plane bridge castle forest lake
    mountain valley desert ocean cloud rain snow wind storm fire metal wood silver gold copper
    red blue green yellow black white small large old new young early late long short high low
    good great big little best better simple clear strong quick slow quiet bright dark warm
    cold dry wet soft hard heavy light rich poor easy happy free full open public private
    local national general special central common recent similar certain major human natural
    make take give find tell ask seem feel try leave call keep begin show hear play run move
    live believe bring happen write provide sit stand lose pay meet include continue learn
    lead understand watch follow stop create speak read spend grow offer remember consider
    appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise
    pass sell require decide return explain hope develop carry break receive agree support
    hit produce eat cover catch draw choose visit walk open close travel count measure carry
    about after before under over between through during without within along across behind
    and but or so because while where when then also very often always never sometimes again
    """.split()
))  # dict.fromkeys: drop repeats, keep order
